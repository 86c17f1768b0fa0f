"""One prepared run on several Slurm nodes: the command a batch script ``exec``s so that
``srun`` starts ``python -m koochak.loop.launch`` once per node and the launcher starts that
node's ranks, each under its own runner.

``distributed_argv(runner_argv, ranks_per_node)`` is ``bash -c NODES_SCRIPT koochak-nodes
RANKS_PER_NODE RUNNER_ARGV...``; ``submit_pazuzu`` submits it for ``resources.nodes > 1``, and
``examples/jobs/slurm_nodes/nodes.sbatch`` is the same script for ``sbatch`` by hand (a test
pins the two together). What the script does, in the allocation's first node:

- the c10d rendezvous listens on that node (the first host of ``SLURM_JOB_NODELIST``) on port
  ``MASTER_PORT`` if set, else ``20000 + job id % 20000``; its id is the job id, so a requeued
  job rendezvouses afresh;
- one ``srun`` task per node (``--cpus-per-task`` = the allocation's per-task CPUs times the
  ranks per node) runs the launcher with the run's own Python (``-I``); the launcher starts
  ``RANKS_PER_NODE`` ranks, each the runner argv itself (``--no-python``), so every rank checks
  the manifest and gets a clean environment plus RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT from the launcher;
- ``exec``: the batch shell becomes ``srun``, so ``scancel --signal=USR1 --batch`` reaches srun,
  which forwards it to every node's launcher, which forwards it to its ranks (75 on every node);
- ``--kill-on-bad-exit=0``: a node whose ranks exited (75 after an evacuation) must not kill the
  others while they finish; ``--wait=60``: once one node's launcher has ended, the others get 60 s
  (``KOOCHAK_NODES_WAIT_S``), then srun kills them, so a node whose rank hangs cannot hold the
  allocation until its time limit.

The job's exit status is srun's: the highest of the nodes' launchers, each the status of its
first failed rank (75 evacuated, 128+N a signal; see ``koochak.loop.launch``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NODES_SCRIPT", "distributed_argv"]

# No single quotes in here: it travels shell-quoted inside the rendered batch script.
NODES_SCRIPT = """\
ranks_per_node="$1"
shift
head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
port="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
exec srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\
  --cpus-per-task="$((${SLURM_CPUS_PER_TASK:-1} * ranks_per_node))" \\
  --kill-on-bad-exit=0 --wait="${KOOCHAK_NODES_WAIT_S:-60}" \\
  "$1" -I -m koochak.loop.launch --nnodes="$SLURM_JOB_NUM_NODES" \\
  --nproc-per-node="$ranks_per_node" --rdzv-backend=c10d --rdzv-endpoint="$head_node:$port" \\
  --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 --no-python "$@"
"""


def distributed_argv(runner_argv: Sequence[str], ranks_per_node: int) -> list[str]:
    """The batch command that runs ``runner_argv`` as ``ranks_per_node`` ranks on every node
    of the allocation (see the module docstring). ``runner_argv[0]`` is the run's Python."""
    if type(ranks_per_node) is not int or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    argv = [str(a) for a in runner_argv]
    if not argv or not argv[0].startswith("/"):
        raise ValueError("runner_argv must start with the run's absolute Python")
    return ["bash", "-c", NODES_SCRIPT, "koochak-nodes", str(ranks_per_node), *argv]

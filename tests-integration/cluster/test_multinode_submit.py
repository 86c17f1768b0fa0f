"""A prepared run through the project's own submission path on two nodes: submit_pazuzu with
nodes=2 renders a batch script that starts `srun ... python -m koochak.loop.launch` on each node
(c10d rendezvous on the first), two ranks per node, each under its own runner, DDP on gloo. The
rendered script runs the recipe examples/jobs/slurm_nodes/nodes.sbatch word for word."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pazuzu
import pytest
from koochak.jobs.slurm_nodes import NODES_SCRIPT, distributed_argv

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "slurm_nodes" / "nodes.sbatch"


def _recipe_code() -> str:
    """The recipe's lines after `set -euo pipefail` (its comments and #SBATCH defaults aside)."""
    text = RECIPE.read_text()
    return text.split("set -euo pipefail\n", 1)[1]


def _rendered(nodes: int, ranks: int) -> str:
    runner = [sys.executable, "-I", "-m", "koochak.jobs.runner", "/runs/x/launch.json", "0" * 64]
    res = pazuzu.SlurmResources(memory_gb_per_node=1, time_limit="00:10:00", nodes=nodes,
                                tasks_per_node=ranks)  # fmt: skip
    job = pazuzu.SlurmJob(name="x", argv=distributed_argv(runner, ranks), cwd="/runs",
                          log_dir="/runs/logs", resources=res)  # fmt: skip
    return pazuzu.slurm.render_slurm_script(job)


def test_the_rendered_batch_script_is_the_recipe():
    script = _rendered(2, 1)
    argv = shlex.split(script.rsplit("\n\n", 1)[1])  # the command after the last blank line
    assert argv[:2] == ["exec", "bash"] and argv[2] == "-c"
    assert argv[3] == NODES_SCRIPT == _recipe_code()
    assert NODES_SCRIPT in (RECIPE.parents[3] / "docs" / "jobs.md").read_text()  # what users read
    assert argv[4:7] == ["koochak-nodes", "1", sys.executable]
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in script
    assert "python -m koochak.loop.launch" not in NODES_SCRIPT  # the run's own Python, -I
    assert '"$1" -I -m koochak.loop.launch' in NODES_SCRIPT and "--rdzv-backend=c10d" in NODES_SCRIPT
    with pytest.raises(ValueError, match="ranks_per_node"):
        distributed_argv(["/py"], 0)
    with pytest.raises(ValueError, match="absolute Python"):
        distributed_argv(["python"], 1)


@pytest.mark.slow
def test_a_prepared_run_trains_on_both_nodes_through_submit_pazuzu(cluster_env, tmp_path):
    from cluster_jobs import ended, logs, prepare, resources, sample_log, submit, wait_for
    from cluster_user import CONFIG
    from koochak.loop.checkpoint import load
    from slurm_jobs import exit_code

    run = prepare(tmp_path, "two-nodes", CONFIG)
    handle = submit(run, resources(nodes=2, ranks_per_node=2))
    fields = wait_for(handle.job_id, ended, 300, "the end")
    assert (fields["JobState"], exit_code(fields)) == ("COMPLETED", 0), logs(handle)
    assert fields["NodeList"] == "node[1-2]"
    seen = sample_log(Path(run.run_dir))
    assert {(s.host, s.world) for s in seen} == {("node1", 4), ("node2", 4)}
    ranks = {host: {s.rank for s in seen if s.host == host} for host in ("node1", "node2")}
    assert sorted(ranks.values(), key=min) == [{0, 1}, {2, 3}]  # two ranks on each node
    ids = sorted(i for s in seen for i in s.ids)
    assert ids == list(range(12 * 4))  # 12 steps of a global batch of 4, each record once
    final = load(str(Path(run.run_dir) / "step000000012.pt"))
    assert final["world_size"] == 4

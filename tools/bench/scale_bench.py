"""Checkpoints at cluster scale: what the busiest process reads, writes and hashes per phase.

    python tools/bench/scale_bench.py                       # N = 1, 2, 4, 8; ~60 MB state
    python tools/bench/scale_bench.py --ranks 2,4 --mb 6    # a quick look
    python tools/bench/scale_bench.py --json                # the raw per-rank counters too
    python tools/bench/scale_bench.py --hsdp --ranks 4,8    # HSDP: shard within a node of 2

For each N, N gloo ranks on CPU (2 ranks per simulated node: ``KOOCHAK_NODE_INDEX`` is
``rank // 2``) shard the same model with FSDP2 (``fully_shard`` over one 1-D mesh; with ``--hsdp``
a 2-D mesh that shards within each node's 2 ranks and replicates across nodes), take one
AdamW step, and then, for each of two tier set-ups:

- ``node``: a ``{node}`` first tier (a directory per node) and a directory replica;
- ``shared``: one shared first tier and a directory replica;

run the phases of a replicated save through the library's own calls:

- ``save``: ``save_sharded`` into the first tier (every rank writes its parts, rank 0 commits);
- ``replicate``: every rank the library lets replicate its own parts copies them to the replica
  (what ``FollowerReplicator`` does in a run);
- ``commit``: rank 0's ``replicate_checkpoint`` (its share of the copy, then the index and the
  ready manifest, once the other ranks' parts are there).

Then, with the first tier deleted (recovery from the replica): ``select``
(``resume_checkpoint("auto", ...)``: the choice and whatever verification it does), ``resume``
(``restore_training_state`` into a fresh sharded model and optimizer) and ``pullback`` (the
coordinator's ``Replicator`` starting with ``pull=`` the resumed checkpoint, as a run's saver
does, until its pull-back into the first tier is done), on N ranks and on a second world of N/2
ranks (resharding). The weights and optimizer state after each resume must equal the saved ones
exactly (SHA256 of every full tensor, compared; the bench fails otherwise).

Counters come from the processes themselves: ``/proc/self/io`` (``rchar``/``wchar``: bytes through
read/write system calls, page cache or not; ``read_bytes``/``write_bytes``: bytes the block layer
moved, mostly 0 here since the files stay cached) and the bytes every ``hashlib.sha256`` of the
process hashed (the bench wraps ``hashlib.sha256`` before importing koochak; nothing of the library
changes, and outside the bench nothing is counted). Each phase is fenced by barriers; a figure is
the busiest rank's count in units of S/N (S: every byte of the checkpoint's objects; N the ranks
of that phase), beside the Done-when bound of issue 36 for it. ``non-tensor`` is every byte of the
checkpoint that is not a sharded tensor's (head or index, fragments, manifest, unsharded tensors,
rank 0's RNG state, which is the checkpoint's ``rng`` field) and not a rank's own RNG part: since
fragment version 2 each rank's RNG state is its own part, written and read only by that rank,
so it counts as that rank's data (``rng parts``, shown beside), not as metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from typing import Any

_real_sha256 = hashlib.sha256
_hashed = [0]
_counting = [True]
_lock = threading.Lock()


class _CountedSha256:
    """``hashlib.sha256`` that adds every byte it hashes to ``_hashed``."""

    def __init__(self, data: Any = b"", **kwargs: Any) -> None:
        self._h = _real_sha256(**kwargs)
        self.name, self.digest_size, self.block_size = "sha256", 32, 64
        if data:
            self.update(data)

    def update(self, data: Any) -> None:
        if _counting[0]:
            with _lock:
                _hashed[0] += memoryview(data).nbytes
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def copy(self) -> Any:
        twin = _CountedSha256()
        twin._h = self._h.copy()
        return twin


PHASES = ("save", "replicate", "commit", "select", "resume", "pullback")
RESUME_PHASES = ("select", "resume", "pullback")
NAME = "step000000001.pt"
LAYERS = 8
MIB = 1 << 20


def counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        io = {k: int(v) for k, v in (line.split(":") for line in f)}
    return {"rchar": io["rchar"], "wchar": io["wchar"], "read_bytes": io["read_bytes"],
            "write_bytes": io["write_bytes"], "hashed": _hashed[0]}  # fmt: skip


def _delta(before: dict[str, int]) -> dict[str, int]:
    now = counters()
    return {k: now[k] - before[k] for k in now}


def _shard_size(args: argparse.Namespace) -> int | None:
    """The ranks of one shard group under ``--hsdp`` (a node's 2), None for 1-D sharding."""
    import torch

    return 2 if args.hsdp and torch.distributed.get_world_size() >= 2 else None


def build(dim: int, seed: int, shard: int | None = None) -> tuple[Any, Any]:
    """The sharded model (``LAYERS`` square Linear layers, each sharded on its own; over groups
    of ``shard`` ranks, replicated across them, when given) and its AdamW after one step of
    fixed gradients: parameters plus two moments, ~12 x dim^2 bytes."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim) for _ in range(LAYERS)))
    world = torch.distributed.get_world_size()
    if shard:
        mesh = init_device_mesh(
            "cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if seed == 0:
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, 0.01 * (i + 1))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def digest_of(model: Any, opt: Any) -> str:
    """SHA256 of every full tensor of the model and the optimizer state (collective)."""
    _counting[0] = False
    try:
        sha = _real_sha256()
        for p in model.parameters():
            sha.update(p.detach().full_tensor().contiguous().numpy().tobytes())
        for p in model.parameters():
            for key in sorted(opt.state.get(p, {})):
                value = opt.state[p][key]
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                sha.update(key.encode() + full.contiguous().numpy().tobytes())
        return sha.hexdigest()
    finally:
        _counting[0] = True


def _replicate_own(first: Any, replica: Any, written: list[tuple[str, int, str]]) -> None:
    """A rank's copy of its own parts into the replica, as FollowerReplicator makes it (and its
    receipt, where the library has them)."""
    from koochak.storage.transfer import CopyItem, copy_objects

    items = [CopyItem(key, size, sha) for key, size, sha in written]
    copy_objects(first, replica, items, show_progress=False)
    try:
        from koochak.loop.checkpoint.part_receipt import put_receipt
    except ImportError:  # before issue 36: the coordinator re-hashed the parts instead
        return
    put_receipt(replica, NAME, int(os.environ["RANK"]), written)


def _self_replicating(nodes: list[int], node_local: bool) -> set[int]:
    """The ranks that copy their own parts to a replica (the coordinator copies the rest)."""
    try:  # the library's rule, where it has one
        from koochak.loop.checkpoint.replication import self_replicating_writers
    except ImportError:  # before issue 36: only followers on another node than rank 0's
        if not node_local:
            return set()
        return {r for r, node in enumerate(nodes) if node != nodes[0]}
    return set(self_replicating_writers(len(nodes)))


def _rng_parts(replica: Any) -> set[str]:
    """The keys of the writers' RNG parts (fragment version 2: field ``rng``), if any."""
    keys = set()
    for f in os.listdir(replica):
        if f.startswith(NAME) and f.endswith("-index"):
            doc = json.loads((replica / f).read_text())
            if isinstance(doc.get("rng"), int):
                keys.add(doc["parts"][doc["rng"]]["key"])
    return keys


def _kind(key: str, rng_parts: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """Which kind of checkpoint object ``key`` is, for the non-tensor breakdown."""
    if key in rng_parts:
        return "rng parts"
    if key == NAME:
        return "index"
    if key.endswith(".ready.json"):
        return "manifest"
    if key.endswith("-index"):
        return "fragments"
    if key.endswith("part-00000-00000"):
        return "part 0"
    return "parts"


def task_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from koochak.loop.checkpoint.layouts.sharded import dtensor_leaves, save_sharded
    from koochak.loop.checkpoint.saver import capture_checkpoint
    from koochak.loop.checkpoint.tiers import node_index, on_this_node, replicate_checkpoint
    from koochak.storage.store import LocalStore

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, opt = build(args.dim, 0, _shard_size(args))
    ckpt = capture_checkpoint(step=1, next_step=2, reason="periodic", model=model, optimizer=opt,
                              scheduler=None, scaler=None, config=None, wall_time=0.0,
                              metrics=None)  # fmt: skip
    try:  # each slab once: under HSDP the other replicate groups' copies are not stored
        from koochak.loop.checkpoint.layouts.sharded import first_copy
    except ImportError:  # before HSDP
        first_copy = lambda dt: True  # noqa: E731
    sharded = sum(dt.to_local().numel() * dt.element_size() for _, dt in dtensor_leaves(ckpt)
                  if first_copy(dt))  # fmt: skip
    totals: list[Any] = [None] * world
    torch.distributed.all_gather_object(totals, sharded)
    nodes: list[Any] = [None] * world
    torch.distributed.all_gather_object(nodes, node_index())
    reference = digest_of(model, opt)
    out: dict[str, Any] = {"digest": reference, "sharded_bytes": sum(totals), "setups": {}}
    for setup in ("node", "shared"):
        base = os.path.join(args.dir, f"w{world}", setup)
        first_where = os.path.join(base, "node{node}" if setup == "node" else "first")
        os.makedirs(on_this_node(first_where), exist_ok=True)
        os.makedirs(os.path.join(base, "replica"), exist_ok=True)
        first = LocalStore(on_this_node(first_where))
        replica = LocalStore(os.path.join(base, "replica"))
        counts: dict[str, Any] = {}
        written: list[tuple[str, int, str]] = []

        torch.distributed.barrier()
        before = counters()
        save_sharded(first, NAME, ckpt, written=written)
        torch.distributed.barrier()
        counts["save"] = _delta(before)

        own = _self_replicating(nodes, setup == "node")
        before = counters()
        if rank in own:
            _replicate_own(first, replica, written)
        torch.distributed.barrier()
        counts["replicate"] = _delta(before)

        before = counters()
        if rank == 0:
            replicate_checkpoint(first, replica, NAME, remote_writers=own)
        torch.distributed.barrier()
        counts["commit"] = _delta(before)

        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, counts)
        size, kinds = None, {}
        if rank == 0:
            rng_parts = _rng_parts(replica.root)
            for f in os.listdir(replica.root):
                if f.startswith(NAME) and not f.endswith("-receipt"):
                    kind = _kind(f, rng_parts)
                    kinds[kind] = kinds.get(kind, 0) + os.path.getsize(replica.root / f)
            size = sum(kinds.values())
        out["setups"][setup] = {"counts": gathered, "size": size, "objects": kinds}
        # Recovery: the first tier is gone (every node's directory of it).
        torch.distributed.barrier()
        if rank == 0:
            for entry in os.listdir(base):
                if entry != "replica":
                    shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
        torch.distributed.barrier()
        out["setups"][setup]["resume"] = resume_phases(args, first_where, replica.root, reference)
    return out


def resume_phases(
    args: argparse.Namespace, first_where: str, replica: str, reference: str | None
) -> dict[str, Any]:
    """select + resume from ``[first tier, replica]`` into a fresh model; per-rank counters."""
    import torch
    from koochak.loop.checkpoint import restore_training_state
    from koochak.loop.checkpoint.resume import resume_checkpoint
    from koochak.loop.checkpoint.tiers import on_this_node

    model, opt = build(args.dim, 1, _shard_size(args))
    counts: dict[str, Any] = {}
    torch.distributed.barrier()
    before = counters()
    found = resume_checkpoint("auto", [on_this_node(first_where), replica], sharded=True,
                              shard_size=_shard_size(args))  # fmt: skip
    torch.distributed.barrier()
    counts["select"] = _delta(before)
    if found is None:
        raise SystemExit("resume found no checkpoint")
    before = counters()
    restore_training_state(found.checkpoint, model, opt)
    torch.distributed.barrier()
    counts["resume"] = _delta(before)
    before = counters()
    if torch.distributed.get_rank() == 0:
        _pull_back(first_where, replica)
    torch.distributed.barrier()
    counts["pullback"] = _delta(before)
    digest = digest_of(model, opt)
    if reference is not None and digest != reference:
        raise SystemExit(f"rank {torch.distributed.get_rank()}: the resumed state differs")
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, counts)
    return {"counts": gathered, "digest": digest}


def _pull_back(first_where: str, replica: str) -> None:
    """What the coordinator's saver does at the start of a run that resumed from the replica:
    its Replicator, told the resumed checkpoint (``pull=``), until the pull-back is done."""
    import torch
    from koochak.loop.checkpoint.replication import (
        ReplicaTier,
        Replicator,
        self_replicating_writers,
    )
    from koochak.loop.checkpoint.tiers import on_this_node
    from koochak.storage.store import LocalStore

    first = on_this_node(first_where)
    os.makedirs(first, exist_ok=True)
    replicator = Replicator(LocalStore(first), [ReplicaTier(1, LocalStore(replica), None)],
                            first_keep_last_k=None, pull=NAME,
                            remote_writers=self_replicating_writers(
                                torch.distributed.get_world_size()))  # fmt: skip
    replicator.before_publish(NAME + ".next")  # returns once the pull-back is done
    replicator.close()


def task_reshard(args: argparse.Namespace) -> dict[str, Any]:
    """Resume on this (smaller) world from each set-up's replica of the bigger one."""
    out = {}
    for setup in ("node", "shared"):
        base = os.path.join(args.dir, f"w{args.source_world}", setup)
        first = os.path.join(base, "node{node}" if setup == "node" else "first")
        out[setup] = resume_phases(args, first, os.path.join(base, "replica"), None)
    return out


def rank_main(args: argparse.Namespace) -> None:
    import torch

    hashlib.sha256 = _CountedSha256  # type: ignore[assignment,misc]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    os.environ["KOOCHAK_NODE_INDEX"] = str(rank // 2)
    torch.distributed.init_process_group("gloo")
    from koochak.loop.dist import exit_distributed_process

    result = {"save": task_save, "reshard": task_reshard}[args.task](args)
    if rank == 0:
        print(json.dumps(result), flush=True)
    exit_distributed_process(0)


def _world(ranks: int, task: str, extra: list[str]) -> Any:
    """Run ``task`` on ``ranks`` gloo processes of this script; rank 0's JSON result."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _gloo_world import run_world

    return run_world(__file__, ranks, task, extra)


# The Done-when bounds of issue 36, as (factor of S/N, MiB), per phase group.
SAVE_BOUND = (2.5, 8)  # reads and hashes, save + replicate + commit
RESUME_BOUND = (1.5, 8)  # reads, hashes and writes, select + resume


def _busiest(counts: list[dict[str, Any]], phases: tuple[str, ...], key: str) -> int:
    return max(sum(rank[p][key] for p in phases) for rank in counts)


def _bound(bound: tuple[float, int], share: float) -> float:
    """A Done-when bound (factor x S/N + MiB) in units of S/N."""
    return (bound[0] * share + bound[1] * MIB) / share


def _verdict(ok: bool) -> str:
    return "within" if ok else "OVER"


def _non_tensor(result: dict[str, Any], data: dict[str, Any]) -> int:
    """The checkpoint's bytes that are neither a sharded tensor's nor a rank's own RNG part."""
    return data["size"] - result["sharded_bytes"] - data.get("objects", {}).get("rng parts", 0)


def report(n: int, result: dict[str, Any], reshard: dict[str, Any] | None) -> list[str]:
    lines = []
    for setup, data in result["setups"].items():
        size = data["size"]
        non_tensor = _non_tensor(result, data)
        share = size / n
        kinds = ", ".join(
            f"{kind} {nbytes / 1e3:.1f} kB"
            for kind, nbytes in sorted(data.get("objects", {}).items())
            if kind != "parts"
        )
        lines.append(f"N={n} {setup:6} S={size / 1e6:.1f} MB  non-tensor {non_tensor / 1e3:.1f} kB"
                     f" ({kinds})")  # fmt: skip
        rows = [(p, [data["counts"]], n) for p in ("save", "replicate", "commit")]
        rows += [(p, [data["resume"]["counts"]], n) for p in RESUME_PHASES]
        if reshard is not None:
            rows += [(f"{p}@N/2", [reshard[setup]["counts"]], n // 2) for p in RESUME_PHASES]
        for phase, (counts,), ranks in rows:
            unit = size / ranks
            key = phase.split("@")[0]
            if key not in counts[0]:  # a run of an older bench
                continue
            cells = [_busiest(counts, (key,), k) / unit for k in ("rchar", "hashed", "wchar")]
            lines.append(f"  {phase:12} read {cells[0]:6.2f}  hashed {cells[1]:6.2f}  "
                         f"written {cells[2]:6.2f}   (x S/{ranks})")  # fmt: skip
        saved = data["counts"]
        total = [_busiest(saved, ("save", "replicate", "commit"), k) / share
                 for k in ("rchar", "hashed")]  # fmt: skip
        bound = _bound(SAVE_BOUND, share)
        lines.append(f"  save+replicate+commit: read {total[0]:.2f}, hashed {total[1]:.2f} x S/{n}"
                     f" (bound {bound:.2f}: {_verdict(max(total) <= bound)})")  # fmt: skip
        worlds = [(n, data["resume"]["counts"])]
        if reshard is not None:
            worlds.append((n // 2, reshard[setup]["counts"]))
        for ranks, counts in worlds:
            unit = size / ranks
            phases = tuple(p for p in RESUME_PHASES if p in counts[0])
            total = [_busiest(counts, phases, k) / unit
                     for k in ("rchar", "hashed", "wchar")]  # fmt: skip
            bound = _bound(RESUME_BOUND, unit)
            lines.append(f"  {'+'.join(phases)} on {ranks}: read {total[0]:.2f}, hashed {total[1]:.2f}, "
                         f"written {total[2]:.2f} x S/{ranks} (bound {bound:.2f}: "
                         f"{_verdict(max(total) <= bound)})")  # fmt: skip
    return lines


def render(path: str) -> None:
    """The tables of an earlier ``--json`` run (its last line), e.g. a run on older code, then
    one markdown table of the busiest rank's read / hashed bytes (x S/N) per phase group."""
    with open(path) as f:
        raw = json.loads(f.read().strip().splitlines()[-1])
    for n, run in raw.items():
        for line in report(int(n), run["save"], run["reshard"]):
            print(line)
    print()
    print("| N | first tier | save | replicate | commit | save+replicate+commit (bound) "
          "| select+resume+pullback at N (bound) | at N/2 (bound) | non-tensor kB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for n, run in raw.items():
        ranks = int(n)
        for setup, data in run["save"]["setups"].items():
            share = data["size"] / ranks

            def cell(counts: Any, phases: tuple[str, ...], unit: float) -> str:
                phases = tuple(p for p in phases if p in counts[0])  # an older bench's run
                keys = ("rchar", "hashed") + (("wchar",) if "resume" in phases else ())
                return " / ".join(f"{_busiest(counts, phases, k) / unit:.2f}" for k in keys)

            row = [n, setup] + [cell(data["counts"], (p,), share)
                                for p in ("save", "replicate", "commit")]  # fmt: skip
            row.append(f"{cell(data['counts'], ('save', 'replicate', 'commit'), share)} "
                       f"({_bound(SAVE_BOUND, share):.2f})")  # fmt: skip
            row.append(f"{cell(data['resume']['counts'], RESUME_PHASES, share)} "
                       f"({_bound(RESUME_BOUND, share):.2f})")  # fmt: skip
            if run["reshard"] is not None:
                half = data["size"] / (ranks // 2)
                row.append(f"{cell(run['reshard'][setup]['counts'], RESUME_PHASES, half)} "
                           f"({_bound(RESUME_BOUND, half):.2f})")  # fmt: skip
            else:
                row.append("-")
            row.append(f"{_non_tensor(run['save'], data) / 1e3:.1f}")
            print("| " + " | ".join(str(c) for c in row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4,8", help="world sizes, comma separated")
    parser.add_argument("--mb", type=float, default=60.0, help="checkpoint size in MB (~)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the raw counters too")
    parser.add_argument(
        "--render", metavar="FILE", help="print the tables of an earlier --json run"
    )
    parser.add_argument("--hsdp", action="store_true",
                        help="HSDP: shard within each node's 2 ranks, replicate across nodes")  # fmt: skip
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="save", help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--source-world", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.render:
        return render(args.render)
    # parameters + two AdamW moments, float32: 12 bytes per parameter
    dim = max(8, int((args.mb * 1e6 / 12 / LAYERS) ** 0.5) // 8 * 8)
    kind = "HSDP (shard groups of 2)" if args.hsdp else "FSDP2 1-D"
    print(f"scale_bench: {LAYERS} Linear({dim}, {dim}) + AdamW, {kind}, 2 ranks per node, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print("figures: the busiest rank's bytes in units of S/N (read = rchar, written = wchar)")
    raw = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for n in [int(x) for x in args.ranks.split(",")]:
            common = ["--dir", scratch, "--dim", str(dim)] + (["--hsdp"] if args.hsdp else [])
            result = _world(n, "save", common)
            reshard = None
            if n >= 2:
                reshard = _world(n // 2, "reshard", [*common, "--source-world", str(n)])
                for setup in reshard:
                    if reshard[setup]["digest"] != result["digest"]:
                        raise SystemExit(f"N={n} -> {n // 2} ({setup}): the resumed state differs")
            for line in report(n, result, reshard):
                print(line, flush=True)
            raw[n] = {"save": result, "reshard": reshard}
            shutil.rmtree(os.path.join(scratch, f"w{n}"), ignore_errors=True)
    if args.json:
        print(json.dumps(raw))


if __name__ == "__main__":
    main()

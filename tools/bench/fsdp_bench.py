"""FSDP2 in koochak: step overhead, sharded saves and resharded loads, each against its baseline.

    python tools/bench/fsdp_bench.py                 # 2 gloo ranks on CPU, every part, ~6 min
    python tools/bench/fsdp_bench.py --only overhead --ranks 4 --steps 100 --repeats 7
    python tools/bench/fsdp_bench.py --only save,load --dir /scratch/me --shm-dir /dev/shm

**overhead**:
Every rank builds the same tiny GPT (``Block`` modules sharded on their own, then the root), the
same AdamW and the same batches; the contenders run interleaved, in alternating order, several
times in one process group:

- ``raw``: forward, backward, ``optimizer.step()``, ``zero_grad``; the loss read to the host every
  50 steps (where koochak logs);
- ``koochak``: ``training_loop`` with ``train.fsdp`` on the same model, data and logging cadence
  (on logging steps it also measures the global gradient norm and gathers every rank's step time,
  which the figure therefore includes).

The figure is rank 0's median wall time per step and its ratio against ``raw`` measured in the
same run (and the best run against the best raw run: load only adds time). Target: <= 1.03x.

**save**: the sharded state of a larger GPT (parameters and AdamW state) saved durably by every
rank at once, Koochak's ``save_sharded`` (each rank writes and SHA256-hashes its parts, rank 0
commits the index and manifest) against ``torch.distributed.checkpoint.save`` with
``FileSystemWriter(sync_files=True)`` (no hash) of the same tensors, on the disk of ``--dir`` and
on ``--shm-dir`` (memory: the CPU is the limit). Figure: DCP's time over Koochak's (>= 1.0: ours
is at least as fast).

**load**: a checkpoint saved on 2x the ranks (resharded) against one saved on the same number
(same size), each chosen, verified and read into a fresh sharded model and optimizer the way a
resume does (``resume_checkpoint(sharded=True)`` + ``restore_training_state``). Figure:
resharded over same size (target <= 1.2x).

**tiers**: FSDP on checkpoint tiers, on the tiny GPT with a save every ``--steps // 4`` steps:
step time of ``training_loop`` with a node-local first tier (``{node}``, each rank playing a node)
replicated to a durable directory, against the same run saving to one tier only (the baseline);
then recovery (``resume_checkpoint(sharded=True)`` + ``restore_training_state``) from the first
tier against recovery from the durable tier with the first tier gone. Figures: ratios to the
baseline (step time) and to recovery from the first tier.

Contenders are interleaved in alternating order; medians of ``--repeats``; the load average is
printed with the figures, since the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LOG_EVERY = 50
VOCAB, SEQ, DIM, DEPTH = 64, 32, 128, 4
BIG_DIM, BIG_DEPTH = 384, 6  # save/load: about 10.7M parameters, 128 MB with AdamW state


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def fresh() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batches(steps: int, local_batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    return [torch.randint(0, VOCAB, (local_batch, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def run_raw(data: list[torch.Tensor]) -> tuple[float, float]:
    model = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logged = []
    torch.distributed.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for step, tokens in enumerate(data):
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0 or step + 1 == len(data):
            logged.append(loss.item())
    return (time.perf_counter() - start) / len(data), (time.thread_time() - cpu) / len(data)


def run_koochak(data: list[torch.Tensor]) -> tuple[float, float]:
    from koochak.loop import training_loop

    marks: dict[str, float] = {}

    def on_start(info: dict) -> None:
        torch.distributed.barrier()
        marks["start"], marks["cpu_start"] = time.perf_counter(), time.thread_time()

    def on_log(info: dict) -> None:
        marks["end"], marks["cpu_end"] = time.perf_counter(), time.thread_time()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        training_loop(
            model=TinyGPT(),
            dataset=data,
            step_fn=lambda model, tokens, ctx: {"loss": loss_of(model, tokens)},
            optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
            train_cfg={
                "max_steps": len(data),
                "log_every": LOG_EVERY,
                "out_dir": out,
                "device": "cpu",
                "progress_bar": False,
                "shard_dataset": False,
                "warn_unsharded": False,
                "fsdp": {"enabled": True, "shard_modules": ["Block"]},
            },
            hooks={"on_train_start": [on_start], "on_log": [on_log]},
        )
    steps = len(data)
    return (marks["end"] - marks["start"]) / steps, (marks["cpu_end"] - marks["cpu_start"]) / steps


def rank_main(args: argparse.Namespace) -> None:
    from koochak.loop.dist import exit_distributed_process

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    result = {"overhead": bench_overhead, "save": bench_save, "write": write_checkpoint,
              "load": bench_load, "tiers": bench_tiers}[args.task](args)  # fmt: skip
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result), flush=True)
    exit_distributed_process(0)


def bench_overhead(args: argparse.Namespace) -> dict[str, list[Any]]:
    data = batches(args.steps, args.local_batch)
    times: dict[str, list[Any]] = {"raw": [], "koochak": []}
    contenders = {"raw": run_raw, "koochak": run_koochak}
    for repeat in range(args.repeats + 1):
        order = list(contenders) if repeat % 2 == 0 else list(contenders)[::-1]
        for name in order:
            seconds = contenders[name](data)
            if repeat:  # the first round warms up (allocator, thread pools)
                times[name].append(seconds)
    return times


# ----------------------------------------------------------------------------- save and load


def big_state() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A larger sharded GPT with its AdamW state (one step taken), the state every rank saves."""
    global DIM, DEPTH
    saved = DIM, DEPTH
    DIM, DEPTH = BIG_DIM, BIG_DEPTH
    try:
        model = fresh()
    finally:
        DIM, DEPTH = saved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _timed(call) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    call()
    torch.distributed.barrier()
    return time.perf_counter() - start


def bench_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from koochak.loop.checkpoint import build_checkpoint
    from koochak.loop.checkpoint.layouts.sharded import save_sharded
    from koochak.storage.store import LocalStore
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = big_state()
    ckpt = build_checkpoint(step=1, next_step=2, model=model, optimizer=opt)
    dcp_state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    local = sum(t.to_local().numel() * t.element_size() for t in _dtensors(ckpt))
    sizes = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(sizes, local)
    out: dict[str, Any] = {"bytes": sum(sizes)}
    for where, base in (("disk", args.dir), ("shm", args.shm_dir)):
        if not base:
            continue
        times: dict[str, list[float]] = {"koochak": [], "dcp": []}
        for repeat in range(args.repeats + 1):
            order = ["koochak", "dcp"] if repeat % 2 == 0 else ["dcp", "koochak"]
            for name in order:
                target = os.path.join(base, f"fsdp-bench-{name}-{repeat}")
                if name == "koochak":
                    store = LocalStore(target)
                    seconds = _timed(lambda s=store: save_sharded(s, "step000000001.pt", ckpt))
                else:
                    writer = dcp.FileSystemWriter(target, sync_files=True)
                    seconds = _timed(lambda w=writer: dcp.save(dcp_state, storage_writer=w))
                if repeat:
                    times[name].append(seconds)
                torch.distributed.barrier()
                if torch.distributed.get_rank() == 0:
                    shutil.rmtree(target, ignore_errors=True)
        out[where] = times
    return out


def _dtensors(tree: Any) -> list[Any]:
    from koochak.loop.checkpoint.layouts.sharded import dtensor_leaves

    return [dt for _, dt in dtensor_leaves(tree)]


def write_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """Save the big state once into ``--dir/<ranks>`` (the resharded load reads it)."""
    from koochak.loop.checkpoint import build_checkpoint
    from koochak.loop.checkpoint.layouts.sharded import save_sharded
    from koochak.storage.store import LocalStore

    model, opt = big_state()
    ckpt = build_checkpoint(step=1, next_step=2, reason="periodic", model=model, optimizer=opt)
    where = os.path.join(args.load_dir, f"w{torch.distributed.get_world_size()}")
    save_sharded(LocalStore(where), "step000000001.pt", ckpt)
    return {"written": where}


def bench_load(args: argparse.Namespace) -> dict[str, list[float]]:
    from koochak.loop.checkpoint import restore_training_state
    from koochak.loop.checkpoint.resume import resume_checkpoint

    write_checkpoint(args)  # this world's own: the same-size load
    world = torch.distributed.get_world_size()
    sources = {"same size": os.path.join(args.load_dir, f"w{world}"),
               "resharded": os.path.join(args.load_dir, f"w{world * 2}")}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in sources}
    for repeat in range(args.repeats + 1):
        order = list(sources) if repeat % 2 == 0 else list(sources)[::-1]
        for name in order:
            model, opt = big_state()

            def load(where: str = sources[name], model: nn.Module = model, opt: Any = opt) -> None:
                found = resume_checkpoint("auto", where, sharded=True)
                restore_training_state(found.checkpoint, model, opt)

            seconds = _timed(load)
            if repeat:
                times[name].append(seconds)
    return times


# ----------------------------------------------------------------------------- tiers


def run_tiered(data: list[torch.Tensor], first: str, replicas: list[str]) -> float:
    """Seconds per step of ``training_loop`` under FSDP saving every len(data)//4 steps to
    ``first`` (and replicating to ``replicas``), the terminal save's wait included."""
    from koochak.loop import training_loop

    marks: dict[str, float] = {}

    def on_start(info: dict) -> None:
        torch.distributed.barrier()
        marks["start"] = time.perf_counter()

    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        training_loop(
            model=TinyGPT(),
            dataset=data,
            step_fn=lambda model, tokens, ctx: {"loss": loss_of(model, tokens)},
            optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
            train_cfg={"max_steps": len(data), "log_every": LOG_EVERY, "device": "cpu",
                       "out_dir": os.path.dirname(first.rstrip("/")), "checkpoint_dir": first,
                       "checkpoint_replicas": [{"location": r, "create": True} for r in replicas],
                       "ckpt_every": max(1, len(data) // 4),
                       "keep_last_k": 2, "progress_bar": False, "shard_dataset": False,
                       "warn_unsharded": False,
                       "fsdp": {"enabled": True, "shard_modules": ["Block"]}},  # fmt: skip
            hooks={"on_train_start": [on_start]},
        )
    torch.distributed.barrier()
    return (time.perf_counter() - marks["start"]) / len(data)


def bench_tiers(args: argparse.Namespace) -> dict[str, Any]:
    from koochak.loop.checkpoint import restore_training_state
    from koochak.loop.checkpoint.resume import resume_checkpoint

    os.environ["KOOCHAK_NODE_INDEX"] = str(torch.distributed.get_rank())  # a node per rank
    data = batches(args.steps, args.local_batch)
    base = os.path.join(args.dir, "tiers")
    steps: dict[str, list[float]] = {"one tier": [], "node-local + durable": []}
    for repeat in range(args.repeats + 1):
        order = list(steps) if repeat % 2 == 0 else list(steps)[::-1]
        for name in order:
            run = os.path.join(base, f"{'one' if name == 'one tier' else 'two'}{repeat}")
            if name == "one tier":
                seconds = run_tiered(data, os.path.join(run, "first"), [])
            else:
                seconds = run_tiered(data, os.path.join(run, "node{node}"),
                                     [os.path.join(run, "durable")])  # fmt: skip
            if repeat:
                steps[name].append(seconds)
    # Recovery: a shared first tier with a durable one behind it, then with the first one gone.
    shared = os.path.join(base, "recovery")
    run_tiered(data, os.path.join(shared, "first"), [os.path.join(shared, "durable")])
    tiers = {"first tier": [os.path.join(shared, "first"), os.path.join(shared, "durable")],
             "durable tier": [os.path.join(shared, "gone"), os.path.join(shared, "durable")]}  # fmt: skip
    recovery: dict[str, list[float]] = {name: [] for name in tiers}
    for repeat in range(args.repeats + 1):
        order = list(tiers) if repeat % 2 == 0 else list(tiers)[::-1]
        for name in order:
            model = fresh()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def load(where: list = tiers[name], model: nn.Module = model, opt: Any = opt) -> None:
                found = resume_checkpoint("auto", where, sharded=True)
                restore_training_state(found.checkpoint, model, opt)

            seconds = _timed(load)
            if repeat:
                recovery[name].append(seconds)
    return {"steps": steps, "recovery": recovery}


def report(times: dict[str, list[Any]], args: argparse.Namespace) -> None:
    print(f"FSDP2 loop overhead: {args.ranks} gloo ranks, tiny GPT ({DEPTH} Blocks, dim {DIM}), "
          f"{args.steps} steps x {args.repeats} repeats, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for column, clock in ((0, "wall time"), (1, "CPU time of rank 0's training thread")):
        raw = [run[column] for run in times["raw"]]
        print(
            f" {clock}: {'contender':10} {'median ms/step':>15} {'ratio':>7} {'best':>9} {'ratio':>7}"
        )
        for name, runs in times.items():
            values = [run[column] for run in runs]
            med, best = statistics.median(values), min(values)
            print(f" {'':{len(clock)}}  {name:10} {med * 1e3:15.2f} "
                  f"{med / statistics.median(raw):7.3f} {best * 1e3:9.2f} {best / min(raw):7.3f}")  # fmt: skip


def _world(ranks: int, task: str, extra: list[str]) -> Any:
    """Run ``task`` on ``ranks`` gloo processes of this script; rank 0's JSON result."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _gloo_world import run_world

    return run_world(__file__, ranks, task, extra)


def _ratio_table(title: str, times: dict[str, list[float]], base: str) -> None:
    print(title)
    base_med = statistics.median(times[base])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:10} median {med:8.3f} s   ratio to {base}: {med / base_med:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--only", default="overhead,save,load,tiers")
    parser.add_argument("--dir", default=None, help="a directory on disk (default: a temp dir)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="a memory filesystem ('' skips it)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", default="overhead", help=argparse.SUPPRESS)
    parser.add_argument("--load-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        common = ["--ranks", str(args.ranks), "--steps", str(args.steps), "--repeats",
                  str(args.repeats), "--local-batch", str(args.local_batch), "--dir", scratch,
                  "--shm-dir", args.shm_dir, "--load-dir", os.path.join(scratch, "load")]  # fmt: skip
        if "overhead" in only:
            report(_world(args.ranks, "overhead", common), args)
        if "save" in only:
            result = _world(args.ranks, "save", common)
            print(f"sharded save: {args.ranks} ranks, {result['bytes'] / 1e6:.0f} MB of parameters "
                  f"and AdamW state, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
            for where in ("disk", "shm"):
                if where in result:
                    times = result[where]
                    ratio = statistics.median(times["dcp"]) / statistics.median(times["koochak"])
                    _ratio_table(f" on {where}: dcp.save time / koochak time = {ratio:.3f}", times,
                                 "dcp")  # fmt: skip
        if "load" in only:
            _world(args.ranks * 2, "write", common)
            times = _world(args.ranks, "load", common)
            print(f"resharded load: {args.ranks * 2} -> {args.ranks} ranks against "
                  f"{args.ranks} -> {args.ranks}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
            _ratio_table(" chosen, verified and read into a fresh model", times, "same size")
        if "tiers" in only:
            result = _world(args.ranks, "tiers", common)
            print(f"FSDP on tiers: {args.ranks} gloo ranks as {args.ranks} nodes, tiny GPT, "
                  f"{args.steps} steps, a save every {max(1, args.steps // 4)}, load average "
                  f"{os.getloadavg()[0]:.2f}")  # fmt: skip
            _ratio_table(" step time (s/step) while replicating", result["steps"], "one tier")
            _ratio_table(" recovery: chosen, verified, restored", result["recovery"], "first tier")


if __name__ == "__main__":
    main()

"""Per-update overhead of koochak's training_loop against a hand-written PyTorch loop.

Same model init, data, optimizer and seed for every contender; logging every 50 steps (the raw
loop reads the loss to the host there, koochak fires on_log). Every contender marks the clock on
its logging steps, so each run yields 50-step *blocks*; contenders run interleaved, in
alternating order, for several repeats. Two figures per contender, each against the raw loop of
the same run: the **best block** (the fastest 50-step block of all repeats: load only adds
time) and the **median** of the per-repeat paired ratios. Thread CPU time by default: on a
shared machine it is far steadier than wall time.

The anchors (Lightning Trainer, Lightning Fabric, Accelerate, Ignite) run on the same batches,
model init, AdamW and logging cadence, with progress bars, checkpointing and loggers off.
``--anchors`` installs them into a private environment (the root pyproject's ``bench`` group,
synced by uv into ``$KOOCHAK_BENCH_ENV``, default ``~/.cache/koochak-bench/anchors-env``) and
reruns this script there, so the whole table comes from one run.

    python tools/bench/loop_overhead.py                # raw vs koochak (+ anchors if importable)
    python tools/bench/loop_overhead.py --anchors      # with Ignite, Fabric, Trainer, Accelerate
    python tools/bench/loop_overhead.py --full         # the issue's size: more steps and repeats
    python tools/bench/loop_overhead.py --explain      # where koochak's remaining microseconds go
    python tools/bench/loop_overhead.py --ddp 2        # 2 gloo ranks: a raw DDP loop vs koochak

With ``--ddp N`` every contender runs on N gloo processes at once (rank 0's time is reported):
the raw loop wraps the model in DistributedDataParallel and logs its own rank's loss; koochak
runs with ``train.ddp`` and so also reduces the logged metrics across ranks (one gather per
logging step), which the ratio therefore includes.

Goals (issue 30): koochak <= 1.02x raw on the tiny model, <= 1.01x on the MLP, and below every
anchor measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

LOG_EVERY = 50
# Per-thread CPU time by default: with one torch thread all work runs on this thread, and CPU
# time is far less disturbed than wall time on a shared machine (--wall switches back).
CLOCK: Callable[[], float] = time.thread_time


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    in_features: int
    out_features: int
    batch_size: int
    steps: int


GOALS = {"tiny": 1.02, "mlp": 1.01}


def _tiny() -> nn.Module:
    return nn.Linear(32, 32)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def make_data(w: Workload, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(w.batch_size, w.in_features, generator=gen),
            torch.randn(w.batch_size, w.out_features, generator=gen),
        )
        for _ in range(w.steps)
    ]


def fresh(w: Workload) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = w.make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_fn(model: nn.Module, batch, ctx) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}


def is_log_step(step: int, steps: int) -> bool:
    """Every contender reads the loss on the same steps: every LOG_EVERY and the last (as koochak)."""
    return (step + 1) % LOG_EVERY == 0 or step + 1 == steps


class Batches:
    """The pre-built batches as one plain iterable with a length.

    Lightning would read a bare list of batches as a list of *loaders*, and a DataLoader around
    it would add a fetch-and-collate layer the others do not pay, so every framework gets this.
    """

    def __init__(self, data: list) -> None:
        self.data = data

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


@contextlib.contextmanager
def quiet():
    """Silence framework banners, tips and warnings (they are not part of the step cost)."""
    import logging
    import warnings

    loggers = [
        logging.getLogger(name)
        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate", "ignite")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


# ----------------------------------------------------------------------------- contenders
# Each returns the clock at every logging step (setup and teardown excluded): consecutive marks
# bound one LOG_EVERY-step block.


def blocks_of(marks: list[float]) -> list[float]:
    """Seconds per step of each block between consecutive logging-step marks."""
    return [(b - a) / LOG_EVERY for a, b in zip(marks, marks[1:])]


def run_raw(w: Workload, data) -> list[float]:
    model, opt = fresh(w)
    return _raw_steps(model, opt, data)


def _raw_steps(model: nn.Module, opt, data) -> list[float]:
    """The hand-written loop both raw contenders time: to(device), forward, backward, step,
    zero_grad, the loss read on log steps."""
    device = torch.device("cpu")
    logged, marks = [], []
    for step, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            logged.append(loss.item())
            marks.append(CLOCK())
    return marks


def run_koochak(w: Workload, data, training_loop: Callable[..., Any] | None = None) -> list[float]:
    if training_loop is None:
        from koochak.loop import training_loop

    model, opt = fresh(w)
    marks: list[float] = []
    logged = []

    def on_log(info):
        logged.append(info["metrics"]["loss"])
        marks.append(CLOCK())

    # The terminal checkpoint koochak always writes comes after the last on_log: not timed.
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        training_loop(
            model=model,
            dataset=data,
            step_fn=step_fn,
            optimizer=opt,
            train_cfg={
                "max_steps": len(data),
                "log_every": LOG_EVERY,
                "out_dir": out,
                "device": "cpu",
            },
            hooks={"on_log": [on_log]},
        )
    return marks


def run_fabric(w: Workload, data) -> list[float]:
    from lightning.fabric import Fabric

    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fresh(w)
        model, opt = fabric.setup(model, opt)
    marks = []
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            fabric.log("loss", loss.item())
            marks.append(CLOCK())
    return marks


def run_accelerate(w: Workload, data) -> list[float]:
    from accelerate import Accelerator

    with quiet():
        accelerator = Accelerator(cpu=True)
        model, opt = fresh(w)
        model, opt = accelerator.prepare(model, opt)
    marks = []
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            accelerator.log({"loss": loss.item()}, step=step)
            marks.append(CLOCK())
    return marks


def run_ignite(w: Workload, data) -> list[float]:
    from ignite.engine import Engine, Events

    model, opt = fresh(w)
    logged, marks = [], []

    def update(engine, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    engine = Engine(update)
    engine.logger.disabled = True  # per-epoch INFO lines are not part of a step

    # Runs are whole blocks, so the last iteration is a logging one (no second mark at COMPLETED).
    @engine.on(Events.ITERATION_COMPLETED(every=LOG_EVERY))
    def log(engine):
        logged.append(engine.state.output.item())
        marks.append(CLOCK())

    engine.run(Batches(data), max_epochs=1)
    return marks


def run_lightning(w: Workload, data) -> list[float]:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.opt = fresh(w)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            if is_log_step(batch_idx, len(data)):
                self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return self.opt

    marks: list[float] = []

    class Timer(L.Callback):
        # The end of every logging step, as the other contenders mark it.
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if is_log_step(batch_idx, len(data)):
                marks.append(CLOCK())

    with quiet():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=len(data),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            log_every_n_steps=LOG_EVERY,
            callbacks=[Timer()],
        )
        trainer.fit(Module(), Batches(data))
    return marks


def run_raw_ddp(w: Workload, data) -> list[float]:
    """The hand-written DDP loop: DistributedDataParallel, rank-local loss read on log steps."""
    model, opt = fresh(w)
    return _raw_steps(nn.parallel.DistributedDataParallel(model), opt, data)


def run_koochak_ddp(w: Workload, data) -> list[float]:
    """training_loop with train.ddp on the existing process group (metrics reduced on log steps)."""
    from koochak.loop import training_loop

    model, opt = fresh(w)
    marks: list[float] = []

    def on_log(info):
        marks.append(CLOCK())

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        training_loop(
            model=model,
            dataset=data,
            step_fn=step_fn,
            optimizer=opt,
            train_cfg={
                "max_steps": len(data),
                "log_every": LOG_EVERY,
                "out_dir": out,
                "device": "cpu",
                "ddp": True,
                "warn_unsharded": False,
            },  # fmt: skip
            hooks={"on_log": [on_log]},
        )
    return marks


DDP_CONTENDERS = {"raw": run_raw_ddp, "koochak": run_koochak_ddp}


def _ddp_rank(rank: int, world: int, port: int, steps: dict, repeats: int, wall: bool, out: str):
    """One rank of ``--ddp``: every contender, repeat by repeat, in step with the other ranks."""
    global CLOCK
    CLOCK = time.perf_counter if wall else time.thread_time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for w in _workloads(steps):
        data = make_data(w, seed=rank)
        for run in DDP_CONTENDERS.values():  # warm-up
            torch.distributed.barrier()
            run(w, data[: min(len(data), 200)])
        samples: dict[str, list[float]] = {name: [] for name in DDP_CONTENDERS}
        for rep in range(repeats):
            names = list(DDP_CONTENDERS) if rep % 2 == 0 else list(DDP_CONTENDERS)[::-1]
            for name in names:
                torch.distributed.barrier()  # every rank starts a contender together
                samples[name].append(statistics.fmean(blocks_of(DDP_CONTENDERS[name](w, data))))
        results[w.name] = samples
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    from koochak.loop.dist import exit_distributed_process

    exit_distributed_process(0)


def bench_ddp(world: int, steps: dict, repeats: int, wall: bool) -> dict[str, dict[str, dict]]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_ddp_rank, args=(world, port, steps, repeats, wall, out), nprocs=world)
        with open(out) as f:
            raw_samples = json.load(f)
    figures = {}
    for workload, samples in raw_samples.items():
        ratios = [k / r for k, r in zip(samples["koochak"], samples["raw"])]
        figures[workload] = {
            name: {
                "median_s": statistics.median(values),
                "best_s": min(values),
                "ratio": statistics.median(ratios) if name == "koochak" else 1.0,
                "best_ratio": min(values) / min(samples["raw"]),
            }
            for name, values in samples.items()
        }
    return figures


CONTENDERS: dict[str, tuple[str | None, Callable[[Workload, list], list[float]]]] = {
    "raw": (None, run_raw),
    "koochak": (None, run_koochak),
    "lightning_trainer": ("lightning", run_lightning),
    "lightning_fabric": ("lightning", run_fabric),
    "accelerate": ("accelerate", run_accelerate),
    "ignite": ("ignite", run_ignite),
}


def add_baseline_loop(path: str) -> None:
    """Contender ``koochak-baseline``: ``training_loop`` from another version of loop.py (e.g.
    ``git show main:packages/koochak-loop/src/koochak/loop/loop.py > /tmp/loop.py``), imported
    beside this one against the installed package, so a change's before and after run
    interleaved in one process and are each compared with the same raw loop."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("koochak.loop._baseline_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    CONTENDERS["koochak-baseline"] = (
        None, functools.partial(run_koochak, training_loop=module.training_loop))  # fmt: skip


def available() -> tuple[list[str], list[str]]:
    import importlib.util

    present, missing = [], []
    for name, (module, _) in CONTENDERS.items():
        if module is None or importlib.util.find_spec(module) is not None:
            present.append(name)
        else:
            missing.append(f"{name} ({module} not installed)")
    return present, missing


def _workloads(steps: dict) -> list[Workload]:
    return [
        Workload("tiny", _tiny, 32, 32, 8, steps["tiny"]),
        Workload("mlp", _mlp, 784, 10, 64, steps["mlp"]),
    ]


def _main_ddp(args, steps: dict, repeats: int, workloads: list[Workload]) -> int:
    clock = "wall" if args.wall else "thread CPU"
    print(f"loop overhead under DDP: {args.ddp} gloo ranks, {repeats} interleaved repeats, "
          f"median, rank 0's time; torch {torch.__version__}; log every {LOG_EVERY} steps; "
          f"{clock} time")  # fmt: skip
    results = bench_ddp(args.ddp, steps, repeats, args.wall)
    print(f"{'workload':38} {'contender':18} {'median us':>10} {'best us':>9} "
          f"{'vs raw':>8} {'best vs best':>13}")  # fmt: skip
    for w in workloads:
        for name, f in results[w.name].items():
            print(
                f"{w.name:38} {name:18} {f['median_s'] * 1e6:10.1f} {f['best_s'] * 1e6:9.1f} "
                f"{f['ratio']:7.3f}x {f['best_ratio']:12.3f}x"
            )
    verdict = "met" if results[workloads[0].name]["koochak"]["ratio"] <= 1.03 else "MISSED"
    print(f"target koochak <= 1.03x raw DDP on the tiny model: {verdict}")
    if args.json:
        print(json.dumps({"steps": steps, "ranks": args.ddp, "figures": results}))
    return 0


def bench(w: Workload, names: list[str], repeats: int) -> dict[str, dict[str, float]]:
    """Per contender: the best 50-step block and the median per-step time (seconds), the ratio
    of best blocks against raw's and the median of the per-repeat paired ratios.

    Each repeat runs every contender back to back (order alternating), so a paired ratio compares
    runs that saw the same machine load; their median resists the slow drift of a shared
    machine. Load only ever adds time, so the fastest block of all repeats is the other estimate
    of the intrinsic cost.
    """
    data = make_data(w)
    for name in names:  # warm-up: first-call costs (allocator, lazy imports) stay out
        CONTENDERS[name][1](w, data[: min(len(data), 4 * LOG_EVERY)])
    blocks: dict[str, list[float]] = {name: [] for name in names}
    means: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        order = names if rep % 2 == 0 else names[::-1]
        this = {name: blocks_of(CONTENDERS[name][1](w, data)) for name in order}
        for name, run in this.items():
            blocks[name].extend(run)
            means[name].append(statistics.fmean(run))
            ratios[name].append(statistics.fmean(run) / statistics.fmean(this["raw"]))
    best_raw = min(blocks["raw"])
    return {
        name: {
            "best_s": min(blocks[name]),
            "median_s": statistics.median(means[name]),
            "best_ratio": min(blocks[name]) / best_raw,
            "ratio": statistics.median(ratios[name]),
        }
        for name in names
    }


# ------------------------------------------------------------------- where the microseconds go


def explain(w: Workload, steps: int = 1000) -> list[tuple[str, float, float]]:
    """koochak's own Python per update, function by function: ``(function, calls per update,
    self microseconds per update under cProfile)`` for koochak code and the builtins it calls,
    less what the raw loop calls (cProfile inflates every call's cost, so read the ranking and
    the call counts; the absolute times are upper bounds)."""
    import cProfile
    import pstats

    data = make_data(dataclasses.replace(w, steps=steps))

    def profile(run) -> dict[tuple[str, str], tuple[float, float]]:
        per: dict[tuple[str, str], tuple[float, float]] = {}
        for n in (steps // 2, steps):
            prof = cProfile.Profile(time.thread_time)
            prof.enable()
            run(w, data[:n])
            prof.disable()
            for (file, _, fn), (_, calls, tottime, *_rest) in pstats.Stats(prof).stats.items():
                key = (file.rsplit("/", 1)[-1], fn)
                sign = -1 if n != steps else 1
                c, t = per.get(key, (0.0, 0.0))
                per[key] = (c + sign * calls, t + sign * tottime)
        half = steps - steps // 2  # the difference of the two runs: per-update cost, no setup
        return {k: (c / half, t / half) for k, (c, t) in per.items()}

    run_koochak(w, data[: 2 * LOG_EVERY])
    koochak, raw = profile(run_koochak), profile(run_raw)
    rows = []
    for key, (calls, seconds) in koochak.items():
        raw_calls, raw_seconds = raw.get(key, (0.0, 0.0))
        extra_calls, extra_s = calls - raw_calls, seconds - raw_seconds
        if extra_calls >= 0.01 and (key[0] != "~" or extra_calls >= 0.5):
            rows.append((f"{key[0]}:{key[1]}", extra_calls, extra_s * 1e6))
    rows.sort(key=lambda row: -row[2])
    return rows


def opcodes_per_update(
    w: Workload, steps: int = 300
) -> dict[str, dict[tuple[str, int | None], float]]:
    """Python bytecodes executed per update by the raw loop and by koochak, by ``(file, line)``
    (``sys.settrace`` opcode events; the difference of a ``steps // 3`` and a ``steps`` run, so
    setup and teardown cancel). Deterministic: the same on a loaded machine as on an idle one."""
    import collections

    counts: collections.Counter[tuple[str, int | None]] = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            counts[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return tracer

    data = make_data(dataclasses.replace(w, steps=steps))
    result = {}
    for name in ("raw", "koochak"):
        run = CONTENDERS[name][1]
        per: collections.Counter[tuple[str, int | None]] = collections.Counter()
        for n, sign in ((steps // 3, -1), (steps, 1)):
            counts.clear()
            sys.settrace(tracer)
            try:
                run(w, data[:n])
            finally:
                sys.settrace(None)
            for file, c in counts.items():
                per[file] += sign * c
        result[name] = {f: c / (steps - steps // 3) for f, c in per.items() if c}
    return result


def call_cost() -> float:
    """Microseconds of one call of a small Python function with three arguments, unprofiled:
    what each extra call in `explain` costs outside the profiler."""
    import timeit

    def fn(a, b, c):
        return a

    number = 20000
    best = min(timeit.repeat(lambda: fn(1, 2, 3), number=number, repeat=5, timer=time.thread_time))
    return best / number * 1e6


# ----------------------------------------------------------------------------------- anchors

ANCHOR_MODULES = ("ignite", "lightning", "accelerate")


def anchors_env() -> str:
    return os.environ.get("KOOCHAK_BENCH_ENV") or os.path.expanduser(
        "~/.cache/koochak-bench/anchors-env"
    )


def reexec_with_anchors(argv: list[str]) -> int | None:
    """Run this script again in a private environment holding the anchors (the ``bench`` group
    synced by uv into ``anchors_env()``); None when this interpreter already has them."""
    import importlib.util
    import subprocess

    if all(importlib.util.find_spec(m) is not None for m in ANCHOR_MODULES):
        return None
    if os.environ.get("KOOCHAK_BENCH_ANCHORS_REEXEC"):
        print(
            "--anchors: the private environment still lacks "
            + ", ".join(m for m in ANCHOR_MODULES if importlib.util.find_spec(m) is None),
            file=sys.stderr,
        )
        return 2
    env_dir = anchors_env()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=env_dir, KOOCHAK_BENCH_ANCHORS_REEXEC="1")
    print(f"--anchors: syncing the bench group into {env_dir} (uv; the first time takes minutes)",
          flush=True)  # fmt: skip
    sync = subprocess.run(["uv", "sync", "--group", "bench", "--inexact", "-q"], cwd=root, env=env)
    if sync.returncode != 0:
        print(f"--anchors: uv sync failed (exit {sync.returncode})", file=sys.stderr)
        return sync.returncode
    python = os.path.join(env_dir, "bin", "python")
    return subprocess.run([python, os.path.abspath(__file__), *argv], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        default=bool(os.environ.get("KOOCHAK_BENCH_FULL")),
        help="the issue's size (more steps and repeats)",
    )
    parser.add_argument(
        "--baseline-loop",
        default=None,
        metavar="LOOP_PY",
        help="also run training_loop from this loop.py (before vs after)",
    )
    parser.add_argument("--only", default=None, help="comma-separated contenders (raw always runs)")
    parser.add_argument(
        "--anchors",
        action="store_true",
        help="install Ignite, Lightning and Accelerate privately and run them too",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="also print where koochak's remaining microseconds per update go",
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="updates per run (both workloads)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of thread CPU time")
    parser.add_argument(
        "--ddp", type=int, default=0, metavar="N", help="N gloo ranks: raw DDP loop vs koochak"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.anchors:
        code = reexec_with_anchors(argv)
        if code is not None:
            return code
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(args.threads)
    scale = 5 if args.full else 1
    repeats = args.repeats or (21 if args.full else 7)
    steps = {"tiny": 1000 * scale, "mlp": 250 * scale}
    if args.steps:
        steps = {"tiny": args.steps, "mlp": args.steps}
    steps = {k: max(2, v // LOG_EVERY) * LOG_EVERY for k, v in steps.items()}  # whole blocks
    workloads = _workloads(steps)
    if args.ddp:
        return _main_ddp(args, steps, repeats, workloads)
    if args.baseline_loop:
        add_baseline_loop(args.baseline_loop)
    names, missing = available()
    if args.only:
        wanted = {"raw", *args.only.split(",")}
        names = [name for name in names if name in wanted]
    clock = "wall" if args.wall else "thread CPU"
    load = os.getloadavg()[0]
    print(
        f"loop overhead: {repeats} interleaved repeats; torch {torch.__version__}, "
        f"{args.threads} thread(s); log every {LOG_EVERY} steps; {clock} time; "
        f"load average {load:.2f}"
    )
    print("tiny: Linear(32,32), batch 8, " + f"{steps['tiny']} steps; mlp: 784-256-10, batch 64, "
          f"{steps['mlp']} steps; AdamW")  # fmt: skip
    if missing:
        print("skipped: " + ", ".join(missing) + " (--anchors installs them)")
    results = {}
    print(f"{'workload':8} {'contender':18} {'best us':>9} {'median us':>10} {'best vs raw':>12} "
          f"{'median vs raw':>14}")  # fmt: skip
    for w in workloads:
        results[w.name] = figures = bench(w, names, repeats)
        for name, f in figures.items():
            print(
                f"{w.name:8} {name:18} {f['best_s'] * 1e6:9.1f} {f['median_s'] * 1e6:10.1f} "
                f"{f['best_ratio']:11.3f}x {f['ratio']:13.3f}x"
            )
    print("best: the fastest 50-step block of all repeats; median: of the per-repeat means "
          "(ratio: the median of the per-repeat paired ratios)")  # fmt: skip
    verdicts = []
    for w in workloads:
        figures = results[w.name]
        if "koochak" not in figures:
            continue
        k = figures["koochak"]
        goal = GOALS[w.name]
        met = k["best_ratio"] <= goal
        others = [name for name in figures if name not in ("raw", "koochak", "koochak-baseline")]
        below = [name for name in others if k["best_ratio"] < figures[name]["best_ratio"]]
        line = (f"goal {w.name}: koochak <= {goal:.2f}x raw (best block): "
                f"{k['best_ratio']:.3f}x, {'met' if met else 'MISSED'}")  # fmt: skip
        if others:
            line += f"; below {len(below)} of {len(others)} anchors"
            if len(below) < len(others):
                line += " (not below: " + ", ".join(sorted(set(others) - set(below))) + ")"
        if "koochak-baseline" in figures:  # --baseline-loop: this version against that one
            base = figures["koochak-baseline"]
            line += (f"; vs --baseline-loop: best {k['best_ratio']:.3f}x vs "
                     f"{base['best_ratio']:.3f}x, median {k['ratio']:.3f}x vs {base['ratio']:.3f}x")  # fmt: skip
        print(line)
        verdicts.append({"workload": w.name, "ratio": k["best_ratio"], "median_ratio": k["ratio"],
                         "goal": goal, "met": met, "anchors": len(others),
                         "below_anchors": len(below)})  # fmt: skip
    rows = []
    if args.explain:
        w = workloads[0]
        rows = explain(w)
        cost = call_cost()
        calls = sum(row[1] for row in rows)
        print(
            f"\nwhere koochak's remaining time per update goes ({w.name}): the Python calls it "
            f"makes beyond the raw loop's, {calls:.1f} per update; one call costs {cost:.2f} us "
            f"here unprofiled, so about {calls * cost:.1f} us per update. By function (calls "
            "per update; self time under cProfile, which inflates every call, for the ranking):"
        )
        for name, n, us in rows[:12]:
            print(f"  {name:48} {n:6.2f} calls {us:7.2f} us profiled, ~{n * cost:5.2f} us")
        ops = opcodes_per_update(w)
        raw_ops, koochak_ops = sum(ops["raw"].values()), sum(ops["koochak"].values())
        by_file: dict[str, dict[str, float]] = {}
        for name, lines in ops.items():
            for (file, _), c in lines.items():
                short = file.rsplit("/", 1)[-1]
                by_file.setdefault(name, {})[short] = by_file.get(name, {}).get(short, 0.0) + c
        extra = {f: c - by_file["raw"].get(f, 0.0) for f, c in by_file["koochak"].items()}
        top = sorted(((f, c) for f, c in extra.items() if c >= 1), key=lambda fc: -fc[1])[:6]
        print(
            f"Python bytecodes per update (deterministic): raw loop {raw_ops:.0f}, koochak "
            f"{koochak_ops:.0f} (+{koochak_ops - raw_ops:.0f}: "
            + ", ".join(f"{f} {c:+.0f}" for f, c in top)
            + ")"
        )
        print("koochak's own lines, by bytecodes per update (the user's step_fn included):")
        import linecache

        own = [(key, c) for key, c in ops["koochak"].items()
               if c >= 1 and ("/koochak/" in key[0] or key[0] == __file__)]  # fmt: skip
        for (file, line), c in sorted(own, key=lambda kc: -kc[1])[:16]:
            text = linecache.getline(file, line or 0).strip()
            print(f"  {c:5.1f}  {file.rsplit('/', 1)[-1]}:{line}  {text[:70]}")
        rows.append(("bytecodes per update, raw / koochak", raw_ops, koochak_ops))
    load = os.getloadavg()[0]
    print(f"load average at the end: {load:.2f}")
    if args.json:
        print(json.dumps({"steps": steps, "figures": results, "verdicts": verdicts,
                          "load": load, "explain": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-step overhead of koochak's training_loop against a hand-written PyTorch loop.

Same model init, data, optimizer and seed for every contender; logging every 50 steps (the raw
loop reads the loss to the host there, koochak fires on_log). Contenders run interleaved, in
alternating order, for several repeats; the figure is the median per-step time and the ratio
against the raw loop measured in the same run (and, second, the fastest run against the fastest
raw run: load only adds time). Optional frameworks (Lightning Trainer, Lightning Fabric,
Accelerate, Ignite: the ``bench`` dependency group) join when importable, on the same batches,
model init, AdamW and logging cadence, with progress bars, checkpointing and loggers off.

    python tools/bench/loop_overhead.py            # ~1 min alone, ~3 min with the 4 frameworks
    python tools/bench/loop_overhead.py --full     # the issue's size: more steps and repeats
    KOOCHAK_BENCH_FULL=1 python tools/bench/loop_overhead.py
    python tools/bench/loop_overhead.py --only koochak --repeats 31   # raw vs koochak alone
    python tools/bench/loop_overhead.py --ddp 2    # 2 gloo ranks: a raw DDP loop vs koochak

With ``--ddp N`` every contender runs on N gloo processes at once (rank 0's time is reported):
the raw loop wraps the model in DistributedDataParallel and logs its own rank's loss; koochak
runs with ``train.ddp`` and so also reduces the logged metrics across ranks (one gather per
logging step), which the ratio therefore includes.

Target: koochak <= 1.03x raw on the tiny model (where overhead dominates), in both modes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

LOG_EVERY = 50
# Per-thread CPU time by default: with one torch thread all work runs on this thread, and CPU
# time is far less disturbed than wall time on a shared machine (--wall switches back).
CLOCK: Callable[[], float] = time.thread_time


@dataclass(frozen=True)
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    in_features: int
    out_features: int
    batch_size: int
    steps: int


def _tiny() -> nn.Module:
    return nn.Linear(8, 1)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


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
# Each returns seconds per step over the training steps only (setup and teardown excluded).


def run_raw(w: Workload, data) -> float:
    model, opt = fresh(w)
    return _raw_steps(model, opt, data)


def _raw_steps(model: nn.Module, opt, data) -> float:
    """The hand-written loop both raw contenders time: to(device), forward, backward, step,
    zero_grad, the loss read on log steps."""
    device = torch.device("cpu")
    logged = []
    start = CLOCK()
    for step, (x, y) in enumerate(data):
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            logged.append(loss.item())
    return (CLOCK() - start) / len(data)


def run_koochak(w: Workload, data) -> float:
    from koochak.loop import training_loop

    model, opt = fresh(w)
    marks: dict[str, float] = {}
    logged = []

    def on_start(info):
        marks["start"] = CLOCK()

    def on_log(info):
        logged.append(info["metrics"]["loss"])
        marks["end"] = CLOCK()

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
            hooks={"on_train_start": [on_start], "on_log": [on_log]},
        )
    return (marks["end"] - marks["start"]) / len(data)


def run_fabric(w: Workload, data) -> float:
    from lightning.fabric import Fabric

    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1)
        model, opt = fresh(w)
        model, opt = fabric.setup(model, opt)
    start = CLOCK()
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            fabric.log("loss", loss.item())
    return (CLOCK() - start) / len(data)


def run_accelerate(w: Workload, data) -> float:
    from accelerate import Accelerator

    with quiet():
        accelerator = Accelerator(cpu=True)
        model, opt = fresh(w)
        model, opt = accelerator.prepare(model, opt)
    start = CLOCK()
    for step, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if is_log_step(step, len(data)):
            accelerator.log({"loss": loss.item()}, step=step)
    return (CLOCK() - start) / len(data)


def run_ignite(w: Workload, data) -> float:
    from ignite.engine import Engine, Events

    model, opt = fresh(w)
    logged = []

    def update(engine, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    engine = Engine(update)
    engine.logger.disabled = True  # per-epoch INFO lines are not part of a step

    @engine.on(Events.ITERATION_COMPLETED(every=LOG_EVERY) | Events.COMPLETED)
    def log(engine):
        logged.append(engine.state.output.item())

    start = CLOCK()
    engine.run(Batches(data), max_epochs=1)
    return (CLOCK() - start) / len(data)


def run_lightning(w: Workload, data) -> float:
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

    marks: dict[str, float] = {}

    class Timer(L.Callback):
        # First batch start to last batch end: the same span the other contenders time.
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            marks.setdefault("start", CLOCK())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            marks["end"] = CLOCK()

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
    return (marks["end"] - marks["start"]) / len(data)


def run_raw_ddp(w: Workload, data) -> float:
    """The hand-written DDP loop: DistributedDataParallel, rank-local loss read on log steps."""
    model, opt = fresh(w)
    return _raw_steps(nn.parallel.DistributedDataParallel(model), opt, data)


def run_koochak_ddp(w: Workload, data) -> float:
    """training_loop with train.ddp on the existing process group (metrics reduced on log steps)."""
    from koochak.loop import training_loop

    model, opt = fresh(w)
    marks: dict[str, float] = {}

    def on_start(info):
        marks["start"] = CLOCK()

    def on_log(info):
        marks["end"] = CLOCK()

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
            hooks={"on_train_start": [on_start], "on_log": [on_log]},
        )
    return (marks["end"] - marks["start"]) / len(data)


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
                samples[name].append(DDP_CONTENDERS[name](w, data))
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


CONTENDERS: dict[str, tuple[str | None, Callable[[Workload, list], float]]] = {
    "raw": (None, run_raw),
    "koochak": (None, run_koochak),
    "lightning_trainer": ("lightning", run_lightning),
    "lightning_fabric": ("lightning", run_fabric),
    "accelerate": ("accelerate", run_accelerate),
    "ignite": ("ignite", run_ignite),
}


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
        Workload("tiny (Linear 8->1, batch 32)", _tiny, 8, 1, 32, steps["tiny"]),
        Workload("small MLP (128-512-512-10, batch 64)", _mlp, 128, 10, 64, steps["mlp"]),
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
    """Per contender: median and best seconds/step, the median paired ratio and the best ratio.

    Each repeat runs every contender back to back (order alternating), so a ratio compares runs
    that saw the same machine load; the median of those paired ratios resists the slow drift of
    a shared machine better than a ratio of medians. Load only ever adds time, so the ratio of
    the best (fastest) runs is the second estimate of the intrinsic cost.
    """
    data = make_data(w)
    for name in names:  # warm-up: first-call costs (allocator, lazy imports) stay out
        CONTENDERS[name][1](w, data[: min(len(data), 200)])
    samples: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        order = names if rep % 2 == 0 else names[::-1]
        this = {name: CONTENDERS[name][1](w, data) for name in order}
        for name, seconds in this.items():
            samples[name].append(seconds)
            ratios[name].append(seconds / this["raw"])
    best_raw = min(samples["raw"])
    return {
        name: {
            "median_s": statistics.median(samples[name]),
            "best_s": min(samples[name]),
            "ratio": statistics.median(ratios[name]),
            "best_ratio": min(samples[name]) / best_raw,
        }
        for name in names
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        default=bool(os.environ.get("KOOCHAK_BENCH_FULL")),
        help="the issue's size (more steps and repeats)",
    )
    parser.add_argument("--only", default=None, help="comma-separated contenders (raw always runs)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of thread CPU time")
    parser.add_argument(
        "--ddp", type=int, default=0, metavar="N", help="N gloo ranks: raw DDP loop vs koochak"
    )
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.thread_time
    torch.set_num_threads(args.threads)
    scale = 5 if args.full else 1
    repeats = args.repeats or (41 if args.full else 11)
    steps = {"tiny": 2000 * scale, "mlp": 200 * scale}
    workloads = _workloads(steps)
    if args.ddp:
        return _main_ddp(args, steps, repeats, workloads)
    names, missing = available()
    if args.only:
        wanted = {"raw", *args.only.split(",")}
        names = [name for name in names if name in wanted]
    clock = "wall" if args.wall else "thread CPU"
    print(
        f"loop overhead: {repeats} interleaved repeats, median; torch {torch.__version__}, "
        f"{args.threads} thread(s); log every {LOG_EVERY} steps; {clock} time"
    )
    if missing:
        print("skipped: " + ", ".join(missing) + " (install the `bench` dependency group)")
    results = {}
    print(
        f"{'workload':38} {'contender':18} {'median us':>10} {'best us':>9} "
        f"{'vs raw':>8} {'best vs best':>13}"
    )
    for w in workloads:
        results[w.name] = figures = bench(w, names, repeats)
        for name, f in figures.items():
            print(
                f"{w.name:38} {name:18} {f['median_s'] * 1e6:10.1f} {f['best_s'] * 1e6:9.1f} "
                f"{f['ratio']:7.3f}x {f['best_ratio']:12.3f}x"
            )
    print("vs raw: median of the per-repeat paired ratios; best vs best: fastest run / fastest raw")
    tiny = results[workloads[0].name]
    if "koochak" in tiny:
        verdict = "met" if tiny["koochak"]["ratio"] <= 1.03 else "MISSED"
        others = [name for name in tiny if name not in ("raw", "koochak")]
        below = all(tiny["koochak"]["ratio"] < tiny[name]["ratio"] for name in others)
        print(f"target koochak <= 1.03x raw on the tiny model: {verdict}")
        if others:
            print(f"koochak below every framework on the tiny model: {'yes' if below else 'NO'}")
    if args.json:
        print(json.dumps({"steps": {w.name: w.steps for w in workloads}, "figures": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

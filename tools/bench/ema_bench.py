"""EMA update cost: koochak.loop.ema against the AdamW step and torch's AveragedModel.

On one model's parameters (an MLP, about 8.4M parameters by default), with gradients in place:

- ``AdamW.step()`` (torch's default implementation: multi-tensor on CUDA, a per-tensor loop on
  CPU) and ``AdamW(foreach=True)``: the natural baseline, since the EMA update runs once per
  optimizer step and must be cheap next to it (target <= 0.35x);
- ``ModelEma.update`` with one constant shadow, with two power shadows (dual EMA), and with
  ``update_every: 4`` (per model step);
- ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn(decay)`` (the same
  multi-tensor lerp) and with the per-tensor ``get_ema_avg_fn(decay)``: ModelEma should cost
  <= 1.0x the multi-tensor one;
- and the loop overhead of EMA on: ``training_loop`` per-step time with ``train.ema`` on vs off
  on a small MLP.

Contenders run interleaved for ``--repeats`` rounds; each figure is the median time per step and
the ratio against the baseline measured in the same run. CPU by default, with one torch thread and
per-thread CPU time (steadier than wall time on a shared machine; ``--wall`` switches); on CUDA
(``--device cuda``) wall time between device synchronisations.

    python tools/bench/ema_bench.py                    # ~30 s on 2 cores
    python tools/bench/ema_bench.py --width 2048 --repeats 15 --json
    python tools/bench/ema_bench.py --device cuda --width 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(width, width) for _ in range(depth)]
    return nn.Sequential(*layers)


def _with_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _timer(device: torch.device, wall: bool) -> Callable[[], float]:
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter if wall else time.thread_time


def _per_step(
    fn: Callable[[int], None], steps: int, clock: Callable[[], float], first: int
) -> float:
    start = clock()
    for t in range(first, first + steps):
        fn(t)
    return (clock() - start) / steps


def bench_updates(args: argparse.Namespace) -> dict[str, float]:
    from koochak.loop.ema import ModelEma, ShadowSpec, srel_to_gamma
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = _model(args.width, args.depth).to(device)
    _with_grads(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    decay = 0.999
    one = ModelEma(model, [ShadowSpec("constant", decay=decay)])
    dual = ModelEma(model, [ShadowSpec("power", gamma=srel_to_gamma(s)) for s in (0.05, 0.10)])
    thinned = ModelEma(model, [ShadowSpec("constant", decay=decay)], update_every=4)
    averaged_multi = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    averaged_single = AveragedModel(model, avg_fn=get_ema_avg_fn(decay))
    contenders: dict[str, Callable[[int], None]] = {
        "adamw_step": lambda t: optimizer.step(),
        "adamw_foreach_step": lambda t: foreach.step(),
        "koochak_ema": one.update,
        "koochak_dual_power_ema": dual.update,
        "koochak_ema_update_every_4": thinned.update,
        "averaged_model_multi": lambda t: averaged_multi.update_parameters(model),
        "averaged_model_per_tensor": lambda t: averaged_single.update_parameters(model),
    }
    clock = _timer(device, args.wall)
    for fn in contenders.values():  # warm up (allocations, first AveragedModel copy)
        _per_step(fn, 3, clock, 1)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    first = 10
    for round_ in range(args.repeats):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        for name in order:
            times[name].append(_per_step(contenders[name], args.steps, clock, first))
        first += args.steps
    medians = {name: statistics.median(values) for name, values in times.items()}
    params = sum(p.numel() for p in model.parameters())
    return {"parameters": float(params), **{f"{k}_s": v for k, v in medians.items()}}


def bench_loop(args: argparse.Namespace) -> dict[str, float]:
    """training_loop per-step time with EMA on vs off (small MLP, same data and init)."""
    from koochak.loop import training_loop

    device = torch.device(args.device)
    clock = _timer(device, args.wall)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, 128, generator=gen), torch.randn(64, 10, generator=gen))
            for _ in range(args.loop_steps)]  # fmt: skip

    def step_fn(model, batch, ctx):
        x, y = batch
        return {"loss": nn.functional.mse_loss(model(x), y)}

    def run(ema: dict) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10))  # fmt: skip
        times: list[float] = []
        hooks = {"on_step_end": [lambda info: times.append(clock())]}
        with tempfile.TemporaryDirectory() as out:
            training_loop(
                model=model, dataset=data, step_fn=step_fn, hooks=hooks,
                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                train_cfg={"max_steps": args.loop_steps, "log_every": 50, "device": str(device),
                           "out_dir": out, "progress_bar": False, "ema": ema},
            )  # fmt: skip
        steady = times[10:]  # skip the first steps (allocation, warm-up)
        return (steady[-1] - steady[0]) / (len(steady) - 1)

    off, on, dual = [], [], []
    for round_ in range(args.loop_repeats):
        runs = [(off, {}), (on, {"decay": 0.999}),
                (dual, {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}})]  # fmt: skip
        for bucket, ema in runs if round_ % 2 == 0 else list(reversed(runs)):
            bucket.append(run(ema))
    return {
        "loop_ema_off_s": statistics.median(off),
        "loop_ema_on_s": statistics.median(on),
        "loop_dual_ema_on_s": statistics.median(dual),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--width", type=int, default=1024, help="MLP width (params ~ width^2 * depth)"
    )
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="updates per timed block")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--loop-steps", type=int, default=200)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--wall", action="store_true", help="CPU: wall time, not thread CPU time")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {**bench_updates(args), **bench_loop(args)}
    adamw = result["adamw_step_s"]
    multi = result["averaged_model_multi_s"]
    ratios = {
        "ema / adamw step (target <= 0.35)": result["koochak_ema_s"] / adamw,
        "ema / adamw foreach step": result["koochak_ema_s"] / result["adamw_foreach_step_s"],
        "dual power ema / adamw step": result["koochak_dual_power_ema_s"] / adamw,
        "ema update_every 4 / adamw step": result["koochak_ema_update_every_4_s"] / adamw,
        "ema / AveragedModel multi-tensor (target <= 1.0)": result["koochak_ema_s"] / multi,
        "ema / AveragedModel per-tensor": result["koochak_ema_s"]
        / result["averaged_model_per_tensor_s"],
        "loop with ema / without": result["loop_ema_on_s"] / result["loop_ema_off_s"],
        "loop with dual ema / without": result["loop_dual_ema_on_s"] / result["loop_ema_off_s"],
    }
    if args.json:
        print(json.dumps({"device": args.device, "figures": result, "ratios": ratios}, indent=2))
        return 0
    print(f"device {args.device}, {int(result['parameters']):,} parameters, "
          f"{'wall' if args.wall or args.device != 'cpu' else 'thread CPU'} time, "
          f"median of {args.repeats} x {args.steps} updates")  # fmt: skip
    for key, value in result.items():
        if key.endswith("_s"):
            print(f"  {key[:-2]:32s} {value * 1e3:9.3f} ms/step")
    for key, value in ratios.items():
        print(f"  {key:50s} {value:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

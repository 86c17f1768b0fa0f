"""Throughput in every logged row: progress, ETA, tokens/s and MFU, added on logging steps only.

`make_throughput_hooks` (the loop merges them before every other hook, so every sink sees the
fields) adds to each ``on_log`` row:

- ``progress``: updates done / ``train.max_steps`` (0.6; stdout shows ``progress=60/100``;
  absent without a limit);
- ``eta_s``: seconds to ``max_steps`` at this attempt's pace since its first logged row (the
  first row: its own step time), evals and saves included;
- ``tokens_per_s``: when the step returns a ``tokens`` count (this rank's tokens in the
  micro-batch) or ``train.tokens_per_sample`` states it (times ``samples_per_s``);
- ``mfu``: FLOPs per update on one rank / (``step_time_s`` x the device's dense peak), when both
  are known (`koochak.loop.mfu`); a device without a known peak is said once, at the first row.

Every value stays a float. The row is a new dict (``info["metrics"]`` replaced), so checkpoints keep the step's own metrics.
Nothing runs on other steps: the FLOP count hooks the first training forward once and unhooks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from koochak.loop.console import announce
from koochak.loop.hooks import Hooks, rank0_only

__all__ = ["make_throughput_hooks"]


def make_throughput_hooks(train_cfg: Any, world_size: int = 1) -> Hooks:
    """Rank-0 hooks adding ``progress``, ``eta_s``, ``tokens_per_s`` and ``mfu`` to log rows."""
    cfg = train_cfg
    grad_accum = int(cfg.grad_accum)
    max_steps = cfg.max_steps
    state: dict[str, Any] = {"counter": None, "first": None, "peak": None, "said": False,
                             "device": None}  # fmt: skip

    def on_train_start(info: dict[str, Any]) -> None:
        model = info.get("model")
        if model is None:
            return
        params = next(iter(model.parameters()), None)
        state["device"] = params.device if params is not None else None
        if cfg.flops_per_step is None and not cfg.compile and not cfg.fsdp.enabled:
            from koochak.loop.mfu import ForwardFlops

            state["counter"] = ForwardFlops(model)

    def flops_per_update() -> float | None:
        if cfg.flops_per_step is not None:
            return float(cfg.flops_per_step)
        counter = state["counter"]
        if counter is None or counter.flops is None or counter.flops <= 0:
            return None
        return 3.0 * counter.flops * grad_accum

    def peak() -> float | None:
        if state["peak"] is None:
            from koochak.loop.mfu import compute_dtype, peak_flops

            device = state["device"]
            if device is None:
                state["peak"] = (None, "the model has no parameters")
            else:
                state["peak"] = peak_flops(device, compute_dtype(str(cfg.amp), device))
        value, why = state["peak"]
        if value is None and not state["said"]:
            state["said"] = True
            announce(f"no MFU in the logged rows: {why}")
        return value

    def on_log(info: dict[str, Any]) -> None:
        metrics: Mapping[str, Any] = info["metrics"]
        done = int(info["step"]) + 1
        now = time.perf_counter()
        row = dict(metrics)
        if max_steps:
            row["progress"] = done / max_steps
        step_time = metrics.get("step_time_s")
        if state["first"] is None:
            state["first"] = (now, done)
            pace = step_time
        else:
            first_time, first_done = state["first"]
            pace = (now - first_time) / (done - first_done) if done > first_done else step_time
        if max_steps is not None and isinstance(pace, (int, float)):
            row["eta_s"] = max(0, max_steps - done) * float(pace)
        if isinstance(step_time, (int, float)) and step_time > 0:
            tokens = metrics.get("tokens")
            if isinstance(tokens, (int, float)):
                row["tokens_per_s"] = float(tokens) * grad_accum * world_size / step_time
            elif cfg.tokens_per_sample and "samples_per_s" in metrics:
                row["tokens_per_s"] = float(metrics["samples_per_s"]) * cfg.tokens_per_sample
            flops = flops_per_update()
            if flops is not None:
                device_peak = peak()
                if device_peak:
                    row["mfu"] = flops / step_time / device_peak
            elif not state["said"] and cfg.flops_per_step is None:
                state["said"] = True
                if state["counter"] is None:
                    why = "FLOPs are not counted under " + (
                        "train.compile" if cfg.compile else "FSDP"
                    )
                else:  # an update that calls submodules (a GAN's model.G): nothing was counted
                    why = "the model's own forward never ran with gradients, so nothing was counted"
                announce(f"no MFU in the logged rows: {why}; set train.flops_per_step (the "
                         "training FLOPs of one update on one rank)")  # fmt: skip
        info["metrics"] = row

    def on_end(info: dict[str, Any]) -> None:
        if state["counter"] is not None:
            state["counter"].remove()

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(on_log)],
        "on_train_end": [rank0_only(on_end)],
        "on_exception": [rank0_only(on_end)],
    }

"""Model FLOPs utilisation: the FLOPs of one update, and the dense peak of the device doing it.

``MFU = FLOPs per update on one rank / (seconds per update x the device's dense peak FLOP/s)``.

The FLOPs come from ``train.flops_per_step`` or are measured once: `ForwardFlops` counts the
first training forward of the model with torch's FLOP counter
(``torch.utils.flop_counter.FlopCounterMode``) and removes its hooks at once, and an update is
taken as 3 x forward (the backward pass costs twice the forward's matmuls) x ``grad_accum``. Not
measured under ``train.compile`` or FSDP (set ``train.flops_per_step`` there).

The peak is the vendor's dense (no sparsity) figure for the compute dtype: ``bf16``/``fp16``
(``train.amp``), ``tf32`` (fp32 with TF32 matmuls allowed) or ``fp32``, from `PEAK_TFLOPS` by
the CUDA device's name; on a CPU it is measured (the best of a few fp32/bf16 matmuls on this
process's threads). Any other device has no MFU: `peak_flops` returns None and a reason.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["PEAK_TFLOPS", "ForwardFlops", "compute_dtype", "cpu_peak_flops", "peak_flops"]

# Dense peak TFLOP/s per GPU (vendor data sheets, no 2:4 sparsity), by a substring of
# torch.cuda.get_device_name(); the first match wins, so specific names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM / HBM3
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
)


def compute_dtype(amp: str, device: torch.device) -> str:
    """The dtype the matmuls run in: the autocast one, else tf32 where allowed, else fp32."""
    if amp in ("bf16", "fp16"):
        return amp
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def peak_flops(device: torch.device, dtype: str) -> tuple[float | None, str]:
    """``(dense peak FLOP/s of one device, where the figure comes from)``; ``(None, why not)``."""
    if device.type == "cpu":
        return cpu_peak_flops(dtype), f"measured CPU {dtype} matmul peak"
    if device.type != "cuda":
        return None, f"no dense peak is known for a {device.type} device"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            if dtype not in peaks:
                return None, f"{name} has no dense {dtype} peak in koochak.loop.mfu.PEAK_TFLOPS"
            return peaks[dtype] * 1e12, f"{name} dense {dtype} peak {peaks[dtype]:g} TFLOP/s"
    return None, f"{name} is not in koochak.loop.mfu.PEAK_TFLOPS"


_CPU_PEAKS: dict[tuple[str, int], float] = {}


def cpu_peak_flops(dtype: str = "fp32", seconds: float = 0.2) -> float:
    """This CPU's matmul FLOP/s on this process's threads: the best of repeated square matmuls
    (measured once per dtype and thread count; bf16 when ``dtype`` is, else fp32)."""
    key = (dtype, torch.get_num_threads())
    if key in _CPU_PEAKS:
        return _CPU_PEAKS[key]
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    n = 256
    # Its own generator: the probe runs at an attempt's first logged row, after a resumed run's
    # RNG was restored, and a draw from the global stream would change every later dropout mask.
    own = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=own).to(kind)
    b = torch.randn(n, n, generator=own).to(kind)
    best = 0.0
    deadline = time.perf_counter() + seconds
    with torch.no_grad():
        torch.mm(a, b)  # warm up
        while True:
            start = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            took = time.perf_counter() - start
            if took > 0:
                best = max(best, 4 * 2 * n**3 / took)
            if time.perf_counter() > deadline:
                break
    _CPU_PEAKS[key] = best
    return best


class ForwardFlops:
    """Counts the FLOPs of ``model``'s first forward with gradients enabled, then unhooks itself
    (no cost on any later step). ``flops`` is None until then (or when counting failed)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.flops: int | None = None
        self._mode: Any = None
        self._handles = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after),
        ]

    def _before(self, module: Any, args: Any) -> None:
        if self._mode is not None or not torch.is_grad_enabled():
            return  # an eval forward (no_grad) is not the training step's
        from torch.utils.flop_counter import FlopCounterMode

        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.flops = int(mode.get_total_flops())
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._mode is not None:  # entered but the forward never returned
            self._mode.__exit__(None, None, None)
            self._mode = None

"""Mixed precision: `autocast_context(mode, device)` and `Scaler(mode)`.

Modes are ``none``, ``bf16`` and ``fp16``. Only fp16 on CUDA needs loss scaling (its narrow
exponent underflows small gradients), so `Scaler` wraps `torch.amp.GradScaler` there and is a
no-op everywhere else; the loop calls the same methods either way. bf16 on a CPU without native
bfloat16 instructions is emulated and several times slower than float32: `autocast_factory`
warns about it (rank 0, once per call, i.e. once per training run).
"""

from __future__ import annotations

import contextlib
import platform
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any

import torch

AMP_MODES = ("none", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp_mode(mode: str | None) -> str:
    """Return ``mode`` normalised (None -> "none"); ValueError naming ``train.amp`` otherwise."""
    mode = "none" if mode is None else str(mode).lower()
    if mode not in AMP_MODES:
        raise ValueError(f"train.amp: expected one of {'|'.join(AMP_MODES)}, got {mode!r}")
    return mode


def autocast_context(mode: str | None, device: torch.device | str) -> ContextManager[Any]:
    """A context manager running its body under autocast for ``mode`` on ``device``'s type."""
    mode = check_amp_mode(mode)
    if mode == "none":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=_DTYPES[mode])


def autocast_factory(
    mode: str | None, device: torch.device | str
) -> Callable[[], ContextManager[Any]]:
    """A zero-argument factory of fresh autocast contexts (what ``ctx.autocast`` holds)."""
    mode = check_amp_mode(mode)
    device = torch.device(device)
    if mode == "bf16" and device.type == "cpu" and cpu_native_bf16() is False:
        from koochak.loop import dist

        if dist.get_rank() == 0:
            warnings.warn(
                "train.amp: bf16 on a CPU without native bfloat16 instructions (no AVX512_BF16 "
                "or AMX on x86, no BF16 on Arm): autocast emulates it and runs several times "
                "slower than float32; set train.amp: none on this machine",
                RuntimeWarning,
                stacklevel=2,
            )
    return lambda: autocast_context(mode, device)


def cpu_native_bf16() -> bool | None:
    """Whether this CPU computes bfloat16 natively: True, False, or None when it cannot tell
    (then nothing is said). x86: AVX512_BF16 or AMX, as torch detects them; Arm Linux: the
    ``bf16`` feature in /proc/cpuinfo."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        checks = [getattr(torch.cpu, name, None) for name in
                  ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]  # fmt: skip
        if not any(checks):
            return None
        return any(check() for check in checks if check is not None)
    if machine in ("aarch64", "arm64") and platform.system() == "Linux":
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                return any(
                    line.startswith("Features") and "bf16" in line.split(":", 1)[-1].split()
                    for line in f
                )
        except OSError:
            return None
    return None


class Scaler:
    """Loss scaler for ``mode``: a real GradScaler for fp16 on CUDA (``sharded``: FSDP's
    ShardedGradScaler, which agrees across ranks on skipping), otherwise a pass-through.

    ``enabled`` says which. The interface mirrors GradScaler's, so the update sequence reads the
    same with and without scaling: ``scale(loss).backward()``, ``unscale_``, ``step``, ``update``.
    """

    def __init__(
        self, mode: str | None, device: torch.device | str | None = None, *, sharded: bool = False
    ) -> None:
        self.mode = check_amp_mode(mode)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device_type = torch.device(device).type
        self.enabled = self.mode == "fp16" and device_type == "cuda"
        self._scaler: Any = None
        if self.enabled and sharded:
            # Sharded (FSDP) gradients: each rank sees only its shards, so an inf found on one
            # must skip the update on all; this scaler all-reduces what it found.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self._scaler = ShardedGradScaler("cuda")
        elif self.enabled:
            self._scaler = torch.amp.GradScaler("cuda")

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(loss) if self._scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer; with a GradScaler an update whose gradients hold inf/NaN is skipped."""
        if self._scaler is not None:
            self._scaler.step(optimizer)
        else:
            optimizer.step()

    def update(self) -> None:
        if self._scaler is not None:
            self._scaler.update()

    def get_scale(self) -> float:
        return float(self._scaler.get_scale()) if self._scaler is not None else 1.0

    def state_dict(self) -> dict[str, Any] | None:
        """GradScaler state, or None when scaling is off (so checkpoints say so explicitly)."""
        return self._scaler.state_dict() if self._scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self._scaler is not None and state:
            self._scaler.load_state_dict(state)

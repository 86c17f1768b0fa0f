"""GPU health watchdog (CUDA only, opt-in): check the device now and then; leave if it is bad.

Every ``train.gpu_health_every`` completed updates the watchdog runs a tiny known-answer kernel and
reads what torch (and pynvml, when installed) report: memory, temperature, ECC error counts. The
decision is a pure function of those readings (``assess_gpu_health``), so it is tested on CPU with
injected readings. On a bad device the loop publishes a terminal checkpoint and exits with
``GPU_HEALTH_EXIT_CODE``. Koochak never requeues or cancels an allocation itself, and in particular
not under Scruffy (``SCRUFFY_JOB_ID``/``SCRUFFY_ROOT``): the exit code is the whole message and the
scheduler decides. Each check appends one JSON line to ``<out_dir>/gpu_health.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from koochak.loop.config import TrainConfig, as_train_config
from koochak.loop.masking import mask_text

# Distinct from 75 (evacuation) and 76 (checkpoint acknowledgement timeout): "device unhealthy,
# a resumable checkpoint was published, run me elsewhere".
GPU_HEALTH_EXIT_CODE = 79
HEALTH_SUMMARY_NAME = "gpu_health.jsonl"
HEALTH_SUMMARY_VERSION = 1


@dataclass(frozen=True)
class GpuReading:
    """What one check saw on one device; None means "not available here"."""

    device: str
    kernel_ok: bool
    kernel_error: str | None = None
    kernel_seconds: float | None = None
    memory_allocated_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_c: float | None = None
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None


@dataclass(frozen=True)
class HealthPolicy:
    """Limits beyond which a device counts as bad (defaults: the ``train.gpu_health_max_*`` keys')."""

    max_temperature_c: float = TrainConfig.gpu_health_max_temperature_c
    max_kernel_seconds: float = TrainConfig.gpu_health_max_kernel_seconds
    # New uncorrectable ECC errors since the first reading; any is too many.
    max_new_ecc_uncorrected: int = TrainConfig.gpu_health_max_new_ecc_uncorrected


DEFAULT_POLICY = HealthPolicy()


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reasons: tuple[str, ...] = ()


class GpuUnhealthy(SystemExit):
    """Raised by the loop after the health checkpoint is published; exits with code 79."""

    def __init__(self, step: int, verdict: HealthVerdict, path: str | None) -> None:
        super().__init__(GPU_HEALTH_EXIT_CODE)
        self.step = step
        self.verdict = verdict
        self.path = path


def assess_gpu_health(
    reading: GpuReading, policy: HealthPolicy = DEFAULT_POLICY, baseline: GpuReading | None = None
) -> HealthVerdict:
    """Decide from readings alone (pure). ``baseline`` is the first reading of the run."""
    reasons: list[str] = []
    if not reading.kernel_ok:
        reasons.append(
            f"test kernel failed on {reading.device}: {reading.kernel_error or 'wrong result'}"
        )
    if reading.kernel_seconds is not None and reading.kernel_seconds > policy.max_kernel_seconds:
        reasons.append(
            f"test kernel took {reading.kernel_seconds:.2f}s (limit {policy.max_kernel_seconds}s)"
        )
    if reading.temperature_c is not None and reading.temperature_c > policy.max_temperature_c:
        reasons.append(
            f"temperature {reading.temperature_c:.0f}C above {policy.max_temperature_c:.0f}C"
        )
    if reading.ecc_uncorrected is not None:
        before = (
            baseline.ecc_uncorrected if baseline and baseline.ecc_uncorrected is not None else 0
        )
        new = reading.ecc_uncorrected - before
        if new > policy.max_new_ecc_uncorrected:
            reasons.append(f"{new} new uncorrectable ECC error(s)")
    return HealthVerdict(healthy=not reasons, reasons=tuple(reasons))


def read_gpu_health(device: torch.device) -> GpuReading:
    """Run the known-answer kernel on ``device`` and collect the readings available here."""
    name = str(device)
    kernel_ok, kernel_error, seconds = _run_test_kernel(device)
    fields: dict[str, Any] = {}
    try:
        fields["memory_allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        fields["memory_reserved_bytes"] = int(torch.cuda.memory_reserved(device))
        fields["memory_total_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    except Exception:  # a broken device may refuse even these; the kernel result says enough
        pass
    fields.update(_nvml_readings(device))
    return GpuReading(
        device=name,
        kernel_ok=kernel_ok,
        kernel_error=kernel_error,
        kernel_seconds=seconds,
        **fields,
    )


class GpuHealthWatchdog:
    """Checks every ``every`` completed updates; remembers the first reading as the baseline."""

    def __init__(
        self,
        every: int,
        device: torch.device | str,
        out_dir: str | os.PathLike[str] | None = None,
        policy: HealthPolicy = DEFAULT_POLICY,
        reader: Callable[[torch.device], GpuReading] = read_gpu_health,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"train.gpu_health_every must be >= 1 when enabled, got {every}")
        self.every = every
        self.device = torch.device(device)
        self.out_dir = pathlib.Path(out_dir) if out_dir is not None else None
        self.policy = policy
        self.reader = reader
        self.under_scruffy = under_scruffy(os.environ if env is None else env)
        self.baseline: GpuReading | None = None

    def due(self, step: int) -> bool:
        """Whether the update with zero-based index ``step`` ends with a check."""
        return (step + 1) % self.every == 0

    def check(self, step: int) -> HealthVerdict:
        """Read, decide and record; returns the verdict (the loop acts on it)."""
        reading = self.reader(self.device)
        if self.baseline is None:
            self.baseline = reading
        verdict = assess_gpu_health(reading, self.policy, self.baseline)
        self._record(step, reading, verdict)
        return verdict

    def _record(self, step: int, reading: GpuReading, verdict: HealthVerdict) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = {
            "version": HEALTH_SUMMARY_VERSION,
            "time": time.time(),
            "step": step,
            "healthy": verdict.healthy,
            "reasons": [mask_text(reason) for reason in verdict.reasons],
            # Recorded so an operator sees why nothing was requeued: Koochak only exits.
            "under_scruffy": self.under_scruffy,
            "action": "continue" if verdict.healthy else f"checkpoint+exit {GPU_HEALTH_EXIT_CODE}",
            "reading": dataclasses.asdict(reading),
        }
        if reading.kernel_error:  # a CUDA error's text: foreign, so the run's secrets are masked
            line["reading"]["kernel_error"] = mask_text(reading.kernel_error)
        with open(self.out_dir / HEALTH_SUMMARY_NAME, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def make_gpu_health(
    train_cfg: TrainConfig | Mapping[str, Any],
    device: torch.device,
    out_dir: str | os.PathLike[str] | None,
    watchdog: GpuHealthWatchdog | None = None,
) -> GpuHealthWatchdog | None:
    """The loop's watchdog: the argument wins; else ``train.gpu_health_every`` (> 0, CUDA only).

    ``train_cfg`` is the train section: a TrainConfig, or a mapping checked into one. The limits
    come from ``train.gpu_health_max_temperature_c``, ``..._max_kernel_seconds`` and
    ``..._max_new_ecc_uncorrected``.
    """
    if watchdog is not None:
        return watchdog
    cfg = as_train_config(train_cfg)
    if not cfg.gpu_health_every or device.type != "cuda":
        return None
    return GpuHealthWatchdog(cfg.gpu_health_every, device, out_dir, policy=health_policy(cfg))


def health_policy(train_cfg: TrainConfig | Mapping[str, Any]) -> HealthPolicy:
    """The ``HealthPolicy`` the ``train.gpu_health_max_*`` keys describe."""
    cfg = as_train_config(train_cfg)
    return HealthPolicy(
        max_temperature_c=cfg.gpu_health_max_temperature_c,
        max_kernel_seconds=cfg.gpu_health_max_kernel_seconds,
        max_new_ecc_uncorrected=cfg.gpu_health_max_new_ecc_uncorrected,
    )


def under_scruffy(env: Mapping[str, str]) -> bool:
    """Whether this process runs as a Scruffy job (both worker variables present)."""
    return bool(env.get("SCRUFFY_JOB_ID")) and bool(env.get("SCRUFFY_ROOT"))


def _run_test_kernel(device: torch.device) -> tuple[bool, str | None, float | None]:
    # A small matmul whose exact answer is known: integers in float32 stay exact at this size.
    start = time.monotonic()
    try:
        a = torch.arange(64, dtype=torch.float32, device=device).reshape(8, 8)
        got = (a @ a.t()).sum().item()  # .item() synchronizes, so a failed launch surfaces here
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}", time.monotonic() - start
    seconds = time.monotonic() - start
    expected = float(sum(sum(i * j for i, j in zip(r1, r2)) for r1 in _ROWS for r2 in _ROWS))
    if got != expected:
        return False, f"test kernel returned {got}, expected {expected}", seconds
    return True, None, seconds


_ROWS = [[r * 8 + c for c in range(8)] for r in range(8)]


def _nvml_readings(device: torch.device) -> dict[str, Any]:
    try:
        import pynvml  # optional; readings it alone provides are simply absent without it
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out["temperature_c"] = float(
            pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        )
        try:
            out["ecc_uncorrected"] = int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
            out["ecc_corrected"] = int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
        except pynvml.NVMLError:  # ECC reporting disabled or unsupported on this board
            pass
    except Exception:
        return out
    return out

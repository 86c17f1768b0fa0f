"""Safe evacuation: a signal asks the run to leave; it saves a terminal checkpoint and exits 75.

The signal handler only flips an in-memory flag: no I/O, no locks, no collectives, because a
handler can interrupt the training thread anywhere (inside a CUDA call, inside a write). The loop
asks ``should_evacuate()`` at the end of each completed update; under DDP every rank joins one
all-reduce MAX of its flag, so a request seen by any rank moves all of them at the same step.
"""

from __future__ import annotations

import signal as _signal
import threading
from collections.abc import Mapping
from typing import Any

import torch
from koochak.loop import ddp, dist
from koochak.loop.config import TrainConfig, as_train_config

# Reserved exit code: "left on request after publishing a resumable checkpoint".
EVACUATION_EXIT_CODE = 75


class Evacuated(SystemExit):
    """Raised by the loop after the evacuation checkpoint is published; exits with code 75."""

    def __init__(self, step: int, checkpoint: Mapping[str, Any] | None, path: str | None) -> None:
        super().__init__(EVACUATION_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint
        self.path = path


class EvacuationController:
    """Records evacuation requests from a signal (default SIGUSR1) or from code.

    ``install()`` must run on the main thread (Python delivers signals there); ``uninstall()``
    puts the previous handler back. ``request()`` is the programmatic equivalent of the signal.
    """

    def __init__(self, signal: str | int = "USR1") -> None:
        self.signum = _signal_number(signal)
        self._requested = False
        self._previous: Any = None
        self._installed = False

    @property
    def requested(self) -> bool:
        """Whether this process has seen a request (before any cross-rank reconciliation)."""
        return self._requested

    def request(self) -> None:
        """Ask for evacuation, as the signal would."""
        self._requested = True

    def install(self) -> None:
        """Install the recording handler; a no-op if already installed."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "EvacuationController.install() must run on the main thread; signal handlers "
                "can only be installed there"
            )
        self._previous = _signal.signal(self.signum, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        """Restore the handler that was there before ``install()``."""
        if self._installed:
            _signal.signal(self.signum, self._previous)
            self._installed = False

    def should_evacuate(self) -> bool:
        """The reconciled decision: True on every rank if any rank has a request.

        Under an initialized process group all ranks must call this at the same step; it costs
        one tiny all-reduce.
        """
        if not dist.is_initialized():
            return self._requested
        return ddp.any_rank(self._requested, _collective_device())

    def _handle(self, signum: int, frame: Any) -> None:
        # Only record: anything more could deadlock or corrupt the interrupted code.
        self._requested = True


def make_evacuation(
    evacuation: bool | EvacuationController | None, train_cfg: TrainConfig | Mapping[str, Any]
) -> EvacuationController | None:
    """The controller the loop uses: the argument wins, else ``train.evacuation_enabled``.

    ``train_cfg`` is the train section: a TrainConfig, or a mapping checked into one.
    """
    if isinstance(evacuation, EvacuationController):
        return evacuation
    cfg = as_train_config(train_cfg)
    if evacuation is None:
        evacuation = cfg.evacuation_enabled
    if not evacuation:
        return None
    return EvacuationController(signal=cfg.evacuation_signal)


def _signal_number(signal: str | int) -> int:
    if isinstance(signal, int):
        return signal
    name = str(signal).upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    number = getattr(_signal, name, None)
    if not isinstance(number, int):
        raise ValueError(
            f"train.evacuation_signal: unknown signal {signal!r}; expected a name like USR1"
        )
    return int(number)


def _collective_device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Device selection and the current learning rate."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from koochak.loop.config import DEVICE_CHOICES, DEVICE_PATTERN


def get_device(cfg: str | Mapping[str, Any] | torch.device | None = "auto") -> torch.device:
    """Resolve ``train.device`` (``auto|cpu|cuda|cuda:N|mps``) or a train mapping holding it.

    ``auto`` picks ``cuda:$LOCAL_RANK`` when CUDA is available, else the CPU. Asking for CUDA on
    a machine without it is an error rather than a silent CPU run.
    """
    if isinstance(cfg, torch.device):
        return cfg
    if isinstance(cfg, Mapping):
        cfg = cfg.get("device", "auto")
    name = "auto" if cfg is None else str(cfg)
    if not re.fullmatch(DEVICE_PATTERN, name):
        raise ValueError(f"train.device: expected one of {DEVICE_CHOICES}, got {name!r}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"train.device: {name!r} requested but CUDA is not available here")
    return torch.device(name)


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group."""
    return float(optimizer.param_groups[0]["lr"])

"""The recipes' data: batches that are a pure function of the update index (and the rank), so a
resumed run rebuilds exactly the batches the uninterrupted run saw from ``start_step``."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from typing import Any

import torch


def _generator(index: int) -> torch.Generator:
    rank = int(os.environ.get("RANK", "0"))
    return torch.Generator().manual_seed(100_003 * rank + index)


def _first(cfg: Any, start_step: int) -> int:
    """The first batch a run resumed at update ``start_step`` draws (micro-batches consumed)."""
    return start_step * (int(cfg.train.grad_accum) if cfg is not None else 1)


def ring(cfg: Any = None, start_step: int = 0) -> Iterator[torch.Tensor]:
    """Points on a noisy ring (what the GAN learns to draw), 32 per batch."""
    for index in itertools.count(_first(cfg, start_step)):
        g = _generator(index)
        angle = torch.rand(32, generator=g) * 2 * math.pi
        radius = 1 + 0.05 * torch.randn(32, generator=g)
        yield torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)


def regression(cfg: Any = None, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` with y a fixed smooth function of x, 32 per batch."""
    for index in itertools.count(_first(cfg, start_step)):
        x = torch.randn(32, 8, generator=_generator(index))
        yield x, (x[:, :4].sin().sum(dim=1, keepdim=True) + x[:, 4:].mean(dim=1, keepdim=True))


def make_mlp(cfg: Any = None) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def mse_step(model: torch.nn.Module, batch: Any, ctx: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}

"""The tiny model, its checkpoints and batches, shared by the checkpoint tests in this folder.

Fixtures, not imports (tests are collected in importlib mode): ``make_ckpt(step)`` builds a
checkpoint dict of a two-layer model after one Adam step, ``assert_same(a, b)`` compares two
checkpoints exactly (tensors bit for bit, dtypes, containers, NumPy RNG arrays), and
``tiny_model`` / ``tiny_batches`` drive a few real training steps.
"""

from __future__ import annotations

import pytest
import torch
from koochak.loop.checkpoint import build_checkpoint
from koochak.loop.seed import get_rng_state

WIDTH = 16


def _model(width: int = WIDTH) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))


def _ckpt(step: int, *, width: int = WIDTH, loss: float | None = None) -> dict:
    torch.manual_seed(step)
    model = _model(width)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return build_checkpoint(
        step=step,
        next_step=step + 1,
        model=model,
        optimizer=optimizer,
        rng=get_rng_state(),
        metrics={"loss": loss if loss is not None else 1.0 / (step + 1)},
        config={"train": {"lr": 0.1}},
    )


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif hasattr(a, "shape") and hasattr(a, "dtype"):  # NumPy arrays in RNG states
        assert (a == b).all()
    else:
        assert a == b


@pytest.fixture
def make_ckpt():
    return _ckpt


@pytest.fixture
def assert_same():
    return _same


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return _model()


@pytest.fixture
def tiny_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, WIDTH, generator=g) for _ in range(8)]

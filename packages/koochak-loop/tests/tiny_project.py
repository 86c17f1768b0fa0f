"""User code of a tiny ``koochak-train`` project (a Linear(3, 1) learning a sum), shared by the
CLI tests that run one in a subprocess: each adds its own ``step_fn`` (and anything else) after
`user_code`'s head."""

from __future__ import annotations


def user_code(rest: str, *, batch: int = 4) -> str:
    """``make_model`` and an endless, resumable ``dataset`` of ``batch`` samples, then ``rest``
    (which may use ``os``, ``warnings``, ``torch`` and ``F``)."""
    return f'''
import os
import warnings

import torch
from torch.nn import functional as F


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(start_step)
    while True:
        x = torch.randn({batch}, 3, generator=gen)
        yield x, x.sum(1, keepdim=True)

{rest}'''

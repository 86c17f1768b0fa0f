"""The gradient gate: measure -> finite check -> L2 clip, before the optimizer may step.

The loop computes the total norm on the device (`total_norm`), brings that one scalar to the
host together with whatever else the step logs, and hands it to `apply_gate`, which

* recomputes the norm with a scaled reduction when the plain one overflowed to inf in the
  gradients' dtype although every entry is finite (divide by the max |g| first, then sum squares);
* rejects NaN/inf gradients before the optimizer step: an error naming the step and the first
  offending parameter, or, under an fp16 GradScaler, a skipped update as GradScaler does;
* clips in place to ``max_norm`` when clipping is on.

`check_finite` is the optional periodic check (``train.nonfinite_grad_check_every``): it raises
rather than zeroing bad entries, because silently repaired gradients hide a diverging run.

Sharded gradients (FSDP2 DTensors) are handled through their local shards: ``grads_of`` returns
them, and an ``across`` reduction (``koochak.loop.fsdp.ShardReduction``) turns each local figure
into the global one (sum of squares, max, any-rank flag), so every rank measures the full
gradient and they all clip, skip or raise alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from koochak.loop.dist import is_dtensor, local_tensor

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]

# Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does, so a zero norm is safe.
_EPS = 1e-6


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or inf where the update must not proceed."""


class Across(Protocol):
    """How per-rank figures of sharded gradients become global ones (all-reduces)."""

    def sum(self, value: torch.Tensor) -> torch.Tensor: ...

    def max(self, value: torch.Tensor) -> torch.Tensor: ...

    def any(self, flag: bool, device: torch.device) -> bool: ...


def grads_of(named_params: NamedParams) -> list[torch.Tensor]:
    """The gradients present, as this rank holds them (a DTensor's local shard)."""
    return [local_tensor(p.grad) for _, p in named_params if p.grad is not None]


class GradReader:
    """``grads_of(named_params)`` resolved once for a fixed set of parameters: a plain list
    comprehension unless some parameter is a DTensor, and whether every gradient shares one
    device and dtype (a gradient always has its parameter's), so `total_norm` need not ask."""

    def __init__(self, named_params: NamedParams) -> None:
        self.params = [p for _, p in named_params]
        self.sharded = any(is_dtensor(p) for p in self.params)
        self.uniform = len({(p.device, p.dtype) for p in self.params}) <= 1
        self.named_params = named_params

    def __call__(self) -> list[torch.Tensor]:
        if self.sharded:
            return grads_of(self.named_params)
        return [g for g in (p.grad for p in self.params) if g is not None]


def total_norm(
    grads: Sequence[torch.Tensor], across: Across | None = None, *, uniform: bool = False
) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, on their device, in their dtype (no host sync).

    With ``across`` the grads are shards and the norm is the global one: the squares of the
    local norms summed over ranks (one all-reduce). ``uniform`` says the caller knows they share
    one device and dtype (`GradReader.uniform`), which spares two passes over them.
    """
    if across is not None:
        local = total_norm(grads, uniform=uniform).float()
        return across.sum(local * local).sqrt()
    if not grads:
        return torch.zeros(())
    if uniform or (len({g.device for g in grads}) == 1 and len({g.dtype for g in grads}) == 1):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads))))
    # Mixed devices/dtypes are rare (model parallel, mixed-precision params): gather to one.
    first = grads[0]
    norms = [torch.linalg.vector_norm(g).to(device=first.device, dtype=first.dtype) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def scaled_total_norm(grads: Sequence[torch.Tensor], across: Across | None = None) -> float:
    """The L2 norm computed as max|g| * ||g / max|g|||, which cannot overflow for finite entries.

    With ``across``: the max over every rank's shards, then the scaled squares summed over ranks.
    """
    max_abs = max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
    if across is not None:
        max_abs = float(
            across.max(torch.tensor(max_abs, dtype=torch.float64, device=_device(grads)))
        )
    if max_abs == 0.0:
        return 0.0
    squares = sum(float(torch.linalg.vector_norm(g.detach().float() / max_abs)) ** 2 for g in grads)
    if across is not None:
        squares = float(
            across.sum(torch.tensor(squares, dtype=torch.float64, device=_device(grads)))
        )
    return max_abs * math.sqrt(squares)


def _device(grads: Sequence[torch.Tensor]) -> Any:
    return grads[0].device if grads else None


def first_nonfinite(named_params: NamedParams) -> str | None:
    """The name of the first parameter whose gradient holds NaN or inf (cold path: syncs)."""
    for name, p in named_params:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return None


def check_finite(named_params: NamedParams, step: int, across: Across | None = None) -> None:
    """Raise NonFiniteGradientError naming ``step`` and the parameter if any gradient is NaN/inf
    (with ``across``: on any rank, so every rank raises)."""
    grads = grads_of(named_params)
    # One fused reduction and one sync on the ordinary (all finite) path.
    finite = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
    if across is not None:
        finite = not across.any(not finite, _device(grads) or torch.device("cpu"))
    if not finite:
        raise NonFiniteGradientError(
            f"step {step}: non-finite gradient (NaN or inf) in parameter "
            f"{_where(named_params, across)}; raising instead of zeroing it "
            "(train.nonfinite_grad_check_every)"
        )


def _where(named_params: NamedParams, across: Across | None) -> str:
    name = first_nonfinite(named_params)
    if name is not None:
        return repr(name)
    return "(on another rank's shard)" if across is not None else "(unknown)"


def apply_gate(
    named_params: NamedParams,
    norm: float,
    *,
    max_norm: float | None,
    step: int,
    allow_skip: bool = False,
    across: Across | None = None,
) -> dict[str, float] | None:
    """Check and clip gradients given their host-side total ``norm``.

    Returns the metrics to log (``grad_norm``; with clipping also ``grad_clip_coefficient`` and
    ``grad_clip_scaled_norm``, the norm after clipping, i.e. of the update actually applied;
    ``grad_norm_rescaled`` is 1.0 on a step whose plain norm overflowed and was recomputed with
    the scaled reduction), or None when the update
    must be skipped (only with ``allow_skip``, i.e. under an fp16 GradScaler, which then lowers
    its scale). Raises NonFiniteGradientError otherwise. With ``across`` (sharded gradients),
    ``norm`` is the global norm and every decision is taken over all ranks' shards together.
    """
    scaled = False
    if not math.isfinite(norm):
        bad = first_nonfinite(named_params)
        if across is not None:
            grads = grads_of(named_params)
            any_bad = across.any(bad is not None, _device(grads) or torch.device("cpu"))
        else:
            any_bad = bad is not None
        if not any_bad:
            # Every entry is finite: the sum of squares overflowed the dtype. Rescale and retry.
            norm = scaled_total_norm(grads_of(named_params), across)
            scaled = True
        elif allow_skip:
            return None
        else:
            where = repr(bad) if bad is not None else "(on another rank's shard)"
            raise NonFiniteGradientError(
                f"step {step}: non-finite gradient (NaN or inf) in parameter {where}; "
                "the update was rejected before the optimizer step"
            )
    metrics = {"grad_norm": norm}
    if scaled:
        metrics["grad_norm_rescaled"] = 1.0
    if max_norm is None:
        return metrics
    coefficient = min(1.0, max_norm / (norm + _EPS))
    if coefficient < 1.0:
        torch._foreach_mul_(grads_of(named_params), coefficient)
    metrics["grad_clip_coefficient"] = coefficient
    metrics["grad_clip_scaled_norm"] = norm * coefficient
    return metrics

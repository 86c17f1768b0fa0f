"""The update: what one training update computes, and the one contract a custom update meets.

``training_loop(..., update_fn=standard_update)`` calls ``update_fn(batches, model, optimizer,
ctx)`` once per update. The contract:

* ``batches`` — an iterator of on-device batches (``prepare_batch_fn`` applied); take what the
  update needs with ``next(batches)``. When it runs out (``StopIteration``) training ends; a
  partly computed update is dropped, never applied.
* ``model`` — the training model as the loop wrapped it (compiled, DDP). Call it, not its
  submodules: DDP synchronises gradients and ``torch.compile`` compiles only through its forward
  (a model with several parts can dispatch on an argument: ``model(z, "G")``).
* ``optimizer`` — the main optimizer. ``ctx.state`` holds the other stateful objects the run
  checkpoints (``training_loop(state=...)``: a second optimizer, its scheduler, ...).
* ``ctx`` — the `StepContext`: ``device``, ``rank``, ``world_size``, ``autocast()``, ``scaler``,
  ``step``, ``state``, ``step_fn``, ``grad_accum``, ``no_sync``.

It must leave the gradients of the main optimizer's parameters ready for that optimizer's step
(scaled by ``ctx.scaler`` when it is enabled, as `micro_step` leaves them) and return a mapping
with a ``"loss"`` tensor; its other scalars are logged. It may run `micro_step` as often as it
likes, change gradients, and step other optimizers itself (``ctx.scaler.step(opt)`` under fp16).

The loop still owns everything around it: the gradient gate (unscale, finite check, clip: only
over the main optimizer's parameters), ``on_before_optimizer_step``, the main optimizer's step,
``scaler.update()``, EMA, the scheduler, zeroing the model's gradients after the update, and the
cadences (logging, eval, checkpoints, GPU health, evacuation, stop agreement under DDP/FSDP).

`standard_update` is the default: ``grad_accum`` micro-steps, each autocast -> ``step_fn`` ->
scaled backward (``micro_step``, the only copy of it), gradients kept local under DDP/FSDP but
for the last. `bind_update` turns an update function into the loop's per-update callable; for
the default it picks a path with nothing to check per update.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from koochak.loop.gradients import GradReader, apply_gate, check_finite, total_norm
from koochak.loop.precision import Scaler

_END = object()


@dataclass
class StepContext:
    """What ``step_fn``, ``eval_fn`` and ``update_fn`` receive as ``ctx`` (attribute or
    ``ctx["key"]`` access)."""

    device: torch.device
    rank: int
    world_size: int
    autocast: Callable[[], AbstractContextManager[Any]]  # ctx.autocast() -> a fresh context
    scaler: Scaler
    config_json: Mapping[str, Any] | None
    train_cfg: dict[str, Any]
    step: int = 0  # zero-based index of the update being computed
    micro_step: int = 0  # index within the grad_accum micro-batches of this update
    step_fn: Callable[..., Mapping[str, Any]] | None = None
    grad_accum: int = 1
    amp: bool = False  # whether autocast does anything (train.amp is not "none")
    state: Mapping[str, Any] = field(default_factory=dict)  # training_loop(state=...), live
    # What keeps a micro-step's gradients local (DDP's no_sync, FSDP's switch), or None.
    no_sync: Callable[[], AbstractContextManager[Any]] | None = None
    # Fires on_after_backward (set by the loop only when such a hook exists).
    after_backward: Callable[[], None] | None = None
    # Full precision, grad_accum 1, no on_after_backward: a micro-step is step_fn + backward.
    plain: bool = False

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


UpdateFn = Callable[[Iterator[Any], torch.nn.Module, torch.optim.Optimizer, StepContext],
                    Mapping[str, Any]]  # fmt: skip


class DataEnd(Exception):  # noqa: N818 (a signal to the loop, not an error)
    """The data ran out before an update had all it needed (the loop drops that update)."""


def micro_step(model: torch.nn.Module, batch: Any, ctx: StepContext) -> Mapping[str, Any]:
    """One micro-step: [autocast] -> ``ctx.step_fn`` -> loss / ``ctx.grad_accum`` -> scaled
    backward -> ``on_after_backward``; returns ``step_fn``'s outputs."""
    if ctx.amp:
        with ctx.autocast():
            out = ctx.step_fn(model, batch, ctx)
    else:
        out = ctx.step_fn(model, batch, ctx)
    try:
        loss = out["loss"]
    except (KeyError, TypeError, IndexError):
        raise not_a_loss(out, "step_fn") from None
    if ctx.plain:  # nothing to divide, scale or report: what most updates are
        loss.backward()
        return out
    # Dividing each micro-loss by grad_accum makes k accumulated micro-batches equal one k x batch.
    if ctx.grad_accum > 1:
        loss = loss / ctx.grad_accum
    (ctx.scaler.scale(loss) if ctx.scaler.enabled else loss).backward()
    if ctx.after_backward is not None:
        ctx.after_backward()
    return out


def standard_update(
    batches: Iterator[Any], model: torch.nn.Module, optimizer: Any, ctx: StepContext
) -> Mapping[str, Any]:
    """The default update: ``ctx.grad_accum`` micro-steps; returns the mean of their scalars.

    Under DDP and FSDP only the last micro-step reduces gradients across ranks. Data that runs
    out inside an update drops it (with a warning when some micro-batches were already run).
    """
    grad_accum, no_sync = ctx.grad_accum, ctx.no_sync
    pending: dict[str, Any] | None = None
    for micro in range(grad_accum):
        batch = next(batches, _END)
        if batch is _END:
            if micro:
                warnings.warn(
                    f"dataset ran out inside update {ctx.step}: its {micro} micro-batch(es) "
                    f"were dropped rather than applied as a partial grad_accum={grad_accum} "
                    "update",
                    RuntimeWarning,
                    stacklevel=3,
                )
            raise DataEnd
        ctx.micro_step = micro
        if grad_accum == 1:
            return micro_step(model, batch, ctx)
        local = no_sync is not None and micro < grad_accum - 1
        with no_sync() if local else _NULL:
            out = micro_step(model, batch, ctx)
        pending = _accumulate(pending, out, grad_accum)
    assert pending is not None
    return pending


def bind_update(
    update_fn: UpdateFn,
    batches: Iterator[Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: StepContext,
) -> Callable[[], tuple[Mapping[str, Any], Any]]:
    """The loop's per-update callable, its arguments bound once: it returns ``(outputs, last
    batch)`` or raises `DataEnd`. The default update in full precision without accumulation or
    hooks takes a path that checks nothing per update."""
    ctx.plain = (
        ctx.grad_accum == 1
        and not ctx.amp
        and not ctx.scaler.enabled
        and ctx.after_backward is None
    )
    if update_fn is standard_update and ctx.plain:

        def one_batch() -> tuple[Mapping[str, Any], Any]:
            try:
                batch = next(batches)
            except StopIteration:
                raise DataEnd from None
            return micro_step(model, batch, ctx), batch

        return one_batch

    seen = _Seen(batches)

    def update() -> tuple[Mapping[str, Any], Any]:
        try:
            out = update_fn(seen, model, optimizer, ctx)
        except StopIteration:  # next(batches) ran dry inside a custom update
            raise DataEnd from None
        if not isinstance(out, Mapping) or "loss" not in out:
            raise not_a_loss(out, "update_fn")
        return out, seen.last

    return update


class _Seen:
    """``batches``, remembering the last batch handed out (its size gives samples/s)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches, self.last = batches, None

    def __iter__(self) -> _Seen:
        return self

    def __next__(self) -> Any:
        self.last = next(self.batches)
        return self.last


def not_a_loss(out: Any, who: str) -> TypeError:
    return TypeError(
        f"{who} must return a dict with a 'loss' tensor, got {type(out).__name__}"
        + (f" with keys {sorted(out)}" if isinstance(out, Mapping) else "")
    )


def _accumulate(
    total: dict[str, Any] | None, out: Mapping[str, Any], grad_accum: int
) -> dict[str, Any]:
    """Running mean of the micro-steps' scalars (detached; stays on the device)."""
    total = {} if total is None else total
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
        if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
            total[key] = total.get(key, 0.0) + value / grad_accum
    return total


_NULL = contextlib.nullcontext()


# ----------------------------------------------------------------------------- the gradient gate


class GradientGate:
    """Unscale -> finite check -> clip, when anything needs the gradients; built once.

    Called on every update when clipping is on or ``before_step`` is given (it fires
    ``on_before_optimizer_step`` once the gradients are unscaled and clipped: ``every_step``),
    otherwise only on the updates that log or check.
    Returns the gate's metrics and, on logging steps, every logged scalar on the host (read
    together with the norm, in one device sync). ``named_params`` are the main optimizer's;
    ``across`` makes the norm and checks those of every rank's gradient shards together (FSDP).
    """

    def __init__(
        self,
        named_params: list[tuple[str, torch.nn.Parameter]],
        scaler: Scaler,
        optimizer: torch.optim.Optimizer,
        clip: float | None,
        across: Any = None,
        before_step: Callable[[int], None] | None = None,
    ) -> None:
        self.named_params, self.scaler, self.optimizer = named_params, scaler, optimizer
        self.clip, self.across, self.before_step = clip, across, before_step
        self.every_step = clip is not None or before_step is not None
        self.grads = GradReader(named_params)  # resolved once: sharded or not, one dtype or not

    def __call__(
        self, outputs: Mapping[str, Any], is_log: bool, is_check: bool, step: int
    ) -> tuple[dict[str, float] | None, dict[str, float] | None]:
        clip, scaler, across = self.clip, self.scaler, self.across
        if not self.every_step and not is_log and not is_check:
            return None, None
        scaler.unscale_(self.optimizer)
        if clip is None and not is_log and not is_check:
            self.before_step(step)  # unscaled for the hook; nothing to measure
            return None, None
        if is_check and not scaler.enabled:  # under a GradScaler, overflow is a skip
            check_finite(self.named_params, step, across)
        norm = total_norm(self.grads(), across, uniform=self.grads.uniform)
        host: dict[str, float] | None = None
        if is_log:
            host = to_host(outputs, norm)
            norm_value = host.pop("grad_norm")
        else:
            norm_value = norm.item()
        gate = apply_gate(self.named_params, norm_value, max_norm=clip, step=step,
                          allow_skip=scaler.enabled, across=across)  # fmt: skip
        if self.before_step is not None:
            self.before_step(step)  # unscaled, and clipped when clipping is on
        return gate, host


def to_host(outputs: Mapping[str, Any], norm: torch.Tensor | None) -> dict[str, float]:
    """Every scalar of ``outputs`` (and the grad norm) as floats, with a single device read."""
    names, tensors, host = [], [], {}
    for key, value in outputs.items():
        if isinstance(value, torch.Tensor):
            if value.numel() == 1:
                names.append(key)
                tensors.append(value.detach().reshape(()).float())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            host[key] = float(value)
    if norm is not None:
        names.append("grad_norm")
        tensors.append(norm.reshape(()).float())
    if tensors:
        device = tensors[0].device
        values = torch.stack([t.to(device) for t in tensors]).tolist()
        host.update(zip(names, values))
    return host

"""A tiny hook system: a dict of event name -> list of callables, each called with one ``info`` dict.

Compose with `merge` (concatenate per event, in argument order), extend with `add`, fire with
`emit`. A hook that raises is reported with a warning (once per hook when the caller passes a
``warned`` set, as the loop does) and training continues, because a broken logger must not cost a
week of training. Two exceptions fail closed and re-raise: hooks wrapped with `fail_closed`, and
every ``on_train_start`` hook (a run that could not set itself up should not start).

A hook ends training normally by raising `StopTraining` (early stopping, a time or compute
budget): the event's other hooks still run, then `emit` raises it, and the loop finishes the
update, saves a terminal checkpoint, fires ``on_train_end`` and returns (exit 0 in the CLI).
"""

from __future__ import annotations

import difflib
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from koochak.loop import dist

Hook = Callable[[dict[str, Any]], None]
Hooks = dict[str, list[Hook]]

EVENTS = (
    "on_train_start",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_step_end",
    "on_log",
    "on_eval_end",
    "on_checkpoint",
    "on_replication",
    "on_train_end",
    "on_exception",
)
_FAIL_CLOSED_ATTR = "__koochak_fail_closed__"


class StopTraining(Exception):  # noqa: N818 (a request, not an error)
    """Raise from a hook to end training normally after the current update.

    Allowed from ``on_step_end``, ``on_log``, ``on_eval_end`` and ``on_checkpoint``. The loop
    completes the update, all ranks agree (a request on any rank stops every rank), a terminal
    checkpoint with ``reason: "stopped"`` is published, ``on_train_end`` sees ``reason:
    "stopped"`` and ``stop_reason``, and `training_loop` returns it. ``reason`` says why, for
    the logs and the checkpoint.
    """

    def __init__(self, reason: str = "stopped by a hook") -> None:
        super().__init__(reason)
        self.reason = str(reason)


def _check_event(event: str) -> None:
    if event not in EVENTS:
        close = difflib.get_close_matches(str(event), EVENTS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown hook event {event!r}{hint}; expected one of {', '.join(EVENTS)}")


def _check_hooks(hooks: Mapping[str, Iterable[Hook]]) -> None:
    for event, fns in hooks.items():
        _check_event(event)
        if callable(fns) or isinstance(fns, (str, bytes)):
            raise TypeError(
                f"hooks[{event!r}] must be a list of callables, got {type(fns).__name__}"
            )
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"hooks[{event!r}] holds a non-callable {fn!r}")


def merge(*hook_dicts: Mapping[str, Iterable[Hook]] | None) -> Hooks:
    """A new hooks dict with every event's hooks concatenated in argument order (None skipped)."""
    merged: Hooks = {}
    for hooks in hook_dicts:
        if not hooks:
            continue
        _check_hooks(hooks)
        for event, fns in hooks.items():
            merged.setdefault(event, []).extend(fns)
    return merged


def add(hooks: Hooks, event: str, fn: Hook) -> Hooks:
    """Append ``fn`` to ``hooks[event]`` (in place) and return ``hooks`` for chaining."""
    _check_event(event)
    if not callable(fn):
        raise TypeError(f"add(): hook for {event!r} must be callable, got {fn!r}")
    hooks.setdefault(event, []).append(fn)
    return hooks


def fail_closed(fn: Hook) -> Hook:
    """Mark ``fn`` so that an exception it raises aborts training instead of warning."""

    @functools.wraps(fn)
    def wrapper(info: dict[str, Any]) -> None:
        fn(info)

    setattr(wrapper, _FAIL_CLOSED_ATTR, True)
    return wrapper


def is_fail_closed(fn: Hook) -> bool:
    return bool(getattr(fn, _FAIL_CLOSED_ATTR, False))


def rank0_only(fn: Hook) -> Hook:
    """Wrap ``fn`` so it runs only on rank 0 (decided at call time, so it works before DDP init)."""

    @functools.wraps(fn)  # also carries the fail-closed mark over
    def wrapper(info: dict[str, Any]) -> None:
        if dist.get_rank() == 0:
            fn(info)

    return wrapper


def _hook_name(fn: Hook) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def emit(
    hooks: Mapping[str, list[Hook]] | None,
    event: str,
    info: dict[str, Any],
    *,
    warned: set[int] | None = None,
) -> None:
    """Call every hook registered for ``event`` with ``info``, in order.

    A failing hook re-raises when it is fail-closed or the event is ``on_train_start``; otherwise
    it warns and the remaining hooks still run. With a ``warned`` set each hook warns only once.
    A `StopTraining` is raised after the remaining hooks ran (the first one, if several).
    """
    if not hooks:
        return
    stop: StopTraining | None = None
    for fn in hooks.get(event, ()):
        try:
            fn(info)
        except StopTraining as request:
            stop = stop or request
        except Exception as exc:
            if event == "on_train_start" or is_fail_closed(fn):
                raise
            key = id(fn)
            if warned is not None:
                if key in warned:
                    continue
                warned.add(key)
            warnings.warn(
                f"hook {_hook_name(fn)} failed on {event} at step {info.get('step')}: "
                f"{type(exc).__name__}: {exc}; training continues",
                RuntimeWarning,
                stacklevel=2,
            )
    if stop is not None:
        raise stop

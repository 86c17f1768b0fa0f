"""What the CSV and JSONL metric logs share: the record shape, value coercion and the version."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

from koochak.loop.hooks import Hooks, rank0_only

METRIC_LOG_VERSION = 1
# "attempt": the record each attempt starts with; "end": the run's goodput when an attempt ends.
EVENTS = ("log", "eval", "attempt", "end")
# What the attempt and end records hold (JSONL: all of it; CSV: the compact form, two columns).
ATTEMPT_FIELDS = ("attempt", "resumed_from", "resumed_tier", "previous_end", "previous_step",
                  "steps_redone", "note")  # fmt: skip
END_FIELDS = ("attempts", "useful_steps", "wall_s", "goodput_steps_per_s", "goodput", "note")
# Fixed leading CSV columns; metric names may not reuse them.
FIXED_COLUMNS = ("version", "event", "step", "time")


def scalar(name: str, value: Any) -> int | float | str:
    """A metric value as a plain int/float/str; 0-d tensors and numpy scalars are unwrapped."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    raise TypeError(f"metric {name!r}: expected a number or string, got {type(value).__name__}")


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, int | float | str]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping, got {type(metrics).__name__}")
    cleaned = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"metric names must be non-empty strings, got {name!r}")
        cleaned[name] = scalar(name, value)
    return cleaned


def check_event(event: str) -> None:
    if event not in EVENTS:
        raise ValueError(f"metric log event must be one of {', '.join(EVENTS)}, got {event!r}")


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"metric log step must be an int >= 0, got {step!r}")
    return step


def format_number(value: int | float | str) -> str:
    """Compact human formatting for stdout (files keep full precision)."""
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def attempt_fields(attempt: Mapping[str, Any], *, compact: bool = False) -> dict[str, Any]:
    """The attempt record as log fields: ``attempt`` and ``note`` when ``compact`` (CSV)."""
    names = ("attempt", "note") if compact else ATTEMPT_FIELDS
    return {name: attempt[name] for name in names if attempt.get(name) is not None}


def end_fields(run: Mapping[str, Any], *, compact: bool = False) -> dict[str, Any]:
    """The run's goodput at the end of an attempt as log fields (CSV: ``goodput`` and ``note``)."""
    names = ("goodput", "note") if compact else END_FIELDS
    return {name: run[name] for name in names if run.get(name) is not None}


class _MetricFile(Protocol):
    def log(self, step: int, metrics: Mapping[str, Any], *, event: str = "log") -> None: ...

    def close(self) -> None: ...


def metric_file_hooks(logger: _MetricFile, *, compact: bool = False) -> Hooks:
    """Rank-0 hooks writing the attempt record (``on_train_start``), ``on_log``/``on_eval_end``
    and the goodput (``on_train_end``) through ``logger``; closed at the end. ``compact``: the
    attempt and end records as two columns each (CSV)."""

    def on_train_start(info: dict[str, Any]) -> None:
        attempt = info.get("attempt")
        if attempt:
            step = int(attempt.get("start_step", info.get("step", 0)))
            logger.log(step, attempt_fields(attempt, compact=compact), event="attempt")

    def on_log(info: dict[str, Any]) -> None:
        logger.log(info["step"], info["metrics"], event="log")

    def on_eval_end(info: dict[str, Any]) -> None:
        logger.log(info["step"], info["metrics"], event="eval")

    def close(info: dict[str, Any]) -> None:
        logger.close()

    def on_train_end(info: dict[str, Any]) -> None:
        try:
            if info.get("run"):
                logger.log(int(info["step"]), end_fields(info["run"], compact=compact), event="end")
        finally:
            logger.close()

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(on_log)],
        "on_eval_end": [rank0_only(on_eval_end)],
        "on_train_end": [rank0_only(on_train_end)],
        "on_exception": [rank0_only(close)],
    }

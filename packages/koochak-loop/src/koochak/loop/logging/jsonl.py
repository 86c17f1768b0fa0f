"""JSONL metric log: one JSON object per log/eval event, flushed line by line.

Each line is ``{"version": 1, "event": "log"|"eval", "step": n, "time": unix_seconds,
"metrics": {...}}``. Non-finite floats are written as ``NaN``/``Infinity`` (Python's json reads
them; strict JSON parsers do not). Reopening an existing log appends.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from koochak.loop.hooks import Hooks
from koochak.loop.logging._records import (
    METRIC_LOG_VERSION,
    check_event,
    check_step,
    clean_metrics,
    metric_file_hooks,
)

__all__ = ["JSONLLogger", "make_jsonl_hooks", "read_jsonl_log"]

_RECORD_KEYS = {"version", "event", "step", "time", "metrics"}


class JSONLLogger:
    """Append metric records to ``path``; the file is opened on the first record."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                needs_newline = f.read(1) != b"\n"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open across log calls
        if needs_newline:
            # A crash mid-line left a fragment; keep it on its own line rather than corrupt ours.
            self._file.write("\n")

    def log(
        self,
        step: int,
        metrics: Mapping[str, Any],
        *,
        event: str = "log",
        wall_time: float | None = None,
    ) -> None:
        check_event(event)
        record = {
            "version": METRIC_LOG_VERSION,
            "event": event,
            "step": check_step(step),
            "time": time.time() if wall_time is None else float(wall_time),
            "metrics": clean_metrics(metrics),
        }
        if self._file is None:
            self._open()
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read records ``{"event", "step", "time", "metrics"}``; unknown versions or keys are errors."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object")
            if record.get("version") != METRIC_LOG_VERSION:
                raise ValueError(
                    f"{path}:{line_no}: field 'version' is {record.get('version')!r}; this reader "
                    f"supports {METRIC_LOG_VERSION}"
                )
            unknown = set(record) - _RECORD_KEYS
            missing = _RECORD_KEYS - set(record)
            if unknown or missing:
                raise ValueError(
                    f"{path}:{line_no}: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}"
                )
            check_event(record["event"])
            record.pop("version")
            records.append(record)
    return records


def make_jsonl_hooks(path: str | os.PathLike[str]) -> Hooks:
    """Rank-0 hooks appending the attempt record, ``on_log`` and ``on_eval_end`` records and the
    end-of-attempt goodput to the JSONL file at ``path``."""
    return metric_file_hooks(JSONLLogger(path))

"""CSV metric log: one row per log/eval event, one column per metric ever seen.

Columns are ``version,event,step,time`` and then metric names in first-seen order; a cell is
empty when that event did not report the metric. A metric that first appears later extends the
header: the file is rewritten to a temp file beside it and atomically swapped in, so no row is
lost and a crash leaves either the old or the new file. Reopening an existing log (a resumed run)
appends and keeps its columns. Logs live in ``train.out_dir`` (POSIX), never on write-once stores.
"""

from __future__ import annotations

import csv
import io
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from koochak.loop.hooks import Hooks
from koochak.loop.logging._records import (
    FIXED_COLUMNS,
    METRIC_LOG_VERSION,
    check_event,
    check_step,
    clean_metrics,
    metric_file_hooks,
)

__all__ = ["CSVLogger", "make_csv_hooks", "read_csv_log"]


def _cell(value: int | float | str) -> str:
    # repr keeps a float's exact value (and round-trips nan/inf through float()).
    return repr(value) if isinstance(value, float) else str(value)


def _parse(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class CSVLogger:
    """Append metric rows to ``path``; the file is opened on the first row, not at construction."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._columns: list[str] | None = None
        self._file: IO[str] | None = None

    # -- file handling ------------------------------------------------------------------------

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, newline="", encoding="utf-8") as f:
                header = next(csv.reader(f), [])
            if tuple(header[: len(FIXED_COLUMNS)]) != FIXED_COLUMNS:
                raise ValueError(
                    f"{self.path}: not a koochak metric CSV (header starts {header[:4]}, expected "
                    f"{list(FIXED_COLUMNS)}); refusing to append to it"
                )
            self._columns = header
            self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - held open across log calls
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                # A crash mid-row leaves no newline; start a fresh row instead of gluing onto it.
                if f.read(1) != b"\n":
                    self._file.write("\n")
        else:
            self._columns = list(FIXED_COLUMNS)
            self._file = open(self.path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - held open across log calls
            csv.writer(self._file).writerow(self._columns)
            self._file.flush()

    def _extend_header(self, new_columns: list[str]) -> None:
        assert self._file is not None and self._columns is not None
        self._file.close()
        self._file = None
        columns = self._columns + new_columns
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        try:
            # mkstemp creates 0600; keep the log's own permissions across the swap.
            os.fchmod(fd, stat.S_IMODE(os.stat(self.path).st_mode))
            with (
                os.fdopen(fd, "w", newline="", encoding="utf-8") as out,
                open(self.path, newline="", encoding="utf-8") as old,
            ):
                writer = csv.writer(out)
                reader = csv.reader(old)
                next(reader, None)
                writer.writerow(columns)
                for row in reader:
                    if row:
                        writer.writerow(row + [""] * (len(columns) - len(row)))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self._columns = columns
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - held open across log calls

    # -- public API ---------------------------------------------------------------------------

    def log(
        self,
        step: int,
        metrics: Mapping[str, Any],
        *,
        event: str = "log",
        wall_time: float | None = None,
    ) -> None:
        """Write one row; new metric names extend the header without losing earlier rows."""
        check_event(event)
        step = check_step(step)
        values = clean_metrics(metrics)
        clash = [name for name in values if name in FIXED_COLUMNS]
        if clash:
            raise ValueError(f"{self.path}: metric name(s) {clash} clash with fixed CSV columns")
        if self._file is None:
            self._open()
        assert self._columns is not None and self._file is not None
        new = [name for name in values if name not in self._columns]
        if new:
            self._extend_header(new)
        record = {
            "version": str(METRIC_LOG_VERSION),
            "event": event,
            "step": str(step),
            "time": repr(time.time() if wall_time is None else float(wall_time)),
            **{name: _cell(value) for name, value in values.items()},
        }
        buffer = io.StringIO()
        csv.writer(buffer).writerow([record.get(column, "") for column in self._columns])
        # One write per row, then flush, so a reader (or a crash) sees whole rows.
        self._file.write(buffer.getvalue())
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._columns = None


def read_csv_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a metric CSV into records ``{"event", "step", "time", "metrics"}`` (empty cells omitted).

    Rejects files whose fixed columns or ``version`` cells are not the ones this code writes.
    """
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(header[: len(FIXED_COLUMNS)]) != FIXED_COLUMNS:
            raise ValueError(f"{path}: header must start with {list(FIXED_COLUMNS)}, got {header}")
        records = []
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) > len(header):
                raise ValueError(f"{path}:{line}: {len(row)} cells but {len(header)} columns")
            cells = dict(zip(header, row))
            if cells["version"] != str(METRIC_LOG_VERSION):
                raise ValueError(
                    f"{path}:{line}: field 'version' is {cells['version']!r}; this reader "
                    f"supports {METRIC_LOG_VERSION}"
                )
            check_event(cells["event"])
            records.append(
                {
                    "event": cells["event"],
                    "step": int(cells["step"]),
                    "time": float(cells["time"]),
                    "metrics": {
                        name: _parse(text)
                        for name, text in cells.items()
                        if name not in FIXED_COLUMNS and text != ""
                    },
                }
            )
    return records


def make_csv_hooks(path: str | os.PathLike[str]) -> Hooks:
    """Rank-0 hooks appending the attempt record, ``on_log`` and ``on_eval_end`` metrics and the
    end-of-attempt goodput to the CSV at ``path`` (the records as ``attempt``/``goodput`` and a
    ``note`` column)."""
    return metric_file_hooks(CSVLogger(path), compact=True)

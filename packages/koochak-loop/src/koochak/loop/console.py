"""What a person watching a run reads on stderr: Koochak's log lines and warnings, one line each.

`console_logging` (koochak-train enters it once per process) installs one handler on the
``koochak`` logger, so every ``koochak.*`` module's lines (replication, resume selection, tier
skips, evacuation, retries) print as ``HH:MM:SS koochak: message`` (``koochak warning:`` /
``koochak error:`` above INFO), and routes Python warnings through it as ``HH:MM:SS koochak
warning: message`` instead of Python's ``/path/to/module.py:412: UserWarning:`` block (a warning
from another library names it: ``(UserWarning from torch)``). Rank 0 prints at
``logging.level`` (default INFO); the other ranks print errors only, prefixed with their rank, so
N ranks do not print every line N times. The stream is looked up at each line (``sys.stderr``),
so output masking and a progress bar (`koochak.loop.logging.progress.write_line`) see it.
Leaving the context restores the previous logger and warning set-up (in-process callers, tests).

In your own script: ``with console_logging("INFO"): training_loop(...)``, or configure the
``koochak`` logger yourself (the library never configures logging on import).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["LEVELS", "announce", "check_level", "console_logging", "format_warning", "set_level"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_ROOT = "koochak"
_WARNINGS = "koochak.warnings"


def check_level(level: Any, key: str = "logging.level") -> int:
    """``level`` (a name, any case) as a logging level; ValueError naming ``key`` otherwise."""
    name = str(level).upper() if isinstance(level, str) else None
    if name not in LEVELS:
        raise ValueError(f"{key}: expected one of {', '.join(LEVELS)}, got {level!r}")
    return int(getattr(logging, name))


class _Formatter(logging.Formatter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        message = " ".join(record.getMessage().split())  # one line, whatever the text holds
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            message += f": {type(exc).__name__}: {' '.join(str(exc).split())}"
        who = "koochak" if self.rank == 0 else f"koochak[rank {self.rank}]"
        level = "" if record.levelno < logging.WARNING else f" {record.levelname.lower()}"
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        return f"{stamp} {who}{level}: {message}"


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment, through a live progress bar if there is one."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from koochak.loop.logging.progress import write_line

            write_line(self.format(record), sys.stderr)
        except Exception:
            self.handleError(record)


def announce(message: str, *, level: int = logging.INFO, logger: str = "koochak.loop") -> None:
    """A line a person must see (resume, evacuation, a finished run): through the configured
    handler under `console_logging`, else printed as ``koochak: message`` on stderr, so a
    script that never configured logging still sees it."""
    log = logging.getLogger(logger)
    if any(isinstance(h, _StderrHandler) for h in logging.getLogger(_ROOT).handlers):
        log.log(level, "%s", message)
    else:
        print(f"koochak: {message}", file=sys.stderr, flush=True)


def _origin(filename: str) -> str | None:
    """The top-level package a warning came from (None for Koochak itself and user code)."""
    parts = os.path.normpath(filename).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1 :]
            if rest:
                top = rest[0].removesuffix(".py")
                return None if top == _ROOT else top
    return None


def format_warning(message: Any, category: type[Warning], filename: str) -> str:
    """A warning as one line: its text, plus its category and library unless it is Koochak's own
    UserWarning or RuntimeWarning."""
    text = " ".join(str(message).split())
    origin = _origin(filename)
    if origin is not None:
        return f"{text} ({category.__name__} from {origin})"
    if category in (UserWarning, RuntimeWarning):
        return text
    return f"{text} ({category.__name__})"


def set_level(level: Any, rank: int | None = None) -> None:
    """The level of Koochak's lines on this rank (rank 0: ``level``; others: ERROR)."""
    rank = _rank() if rank is None else rank
    logging.getLogger(_ROOT).setLevel(check_level(level) if rank == 0 else logging.ERROR)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def console_logging(level: Any = "INFO", rank: int | None = None) -> Iterator[None]:
    """Koochak's log lines and every warning as one line each on stderr, for the duration."""
    rank = _rank() if rank is None else rank
    logger = logging.getLogger(_ROOT)
    saved_level, saved_show = logger.level, warnings.showwarning
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(rank))
    stale = [h for h in logger.handlers if isinstance(h, _StderrHandler)]
    for old in stale:  # configured once: a nested call replaces, never doubles, the handler
        logger.removeHandler(old)
    logger.addHandler(handler)
    set_level(level, rank)
    warn_log = logging.getLogger(_WARNINGS)

    def show(message: Any, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:  # fmt: skip
        if file is not None and file not in (sys.stderr, sys.__stderr__):
            saved_show(message, category, filename, lineno, file, line)  # an explicit target
            return
        warn_log.warning("%s", format_warning(message, category, filename))

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = saved_show
        logger.removeHandler(handler)
        for old in stale:
            logger.addHandler(old)
        logger.setLevel(saved_level)

"""A tqdm progress bar over optimizer updates, shown only on an interactive terminal.

In logs and CI (stdout not a TTY) the hooks are empty and tqdm is never imported, so the extra is
only needed where a bar would actually be drawn. Neither is a bar drawn on a terminal that
reports 0 columns (a pty allocated without a size, as some job launchers do): tqdm would then
draw an unbounded line that wraps on the real screen, and clearing it before a log line
(`write_line`) would only clear its last row, tearing the output.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

from koochak.loop.hooks import Hooks, rank0_only

__all__ = ["make_progress_hooks", "terminal_columns", "write_line"]


def _import_tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError(
            "the progress bar needs tqdm; install the extra: pip install 'koochak-loop[tqdm]'"
        ) from None
    return tqdm


def terminal_columns(stream: Any) -> int:
    """The width of the terminal ``stream`` writes to; 0 when unknown (not a terminal, or one
    that reports no size)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def write_line(line: str, stream: IO[str]) -> None:
    """Write ``line`` and a newline to ``stream`` through any live progress bar: the bar is
    cleared, the line written and the bar redrawn below it (``tqdm.write``), so a log line never
    lands inside a bar. Without tqdm loaded there is no bar: a plain write."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and hasattr(tqdm, "tqdm"):
        tqdm.tqdm.write(line, file=stream)
    else:
        stream.write(line + "\n")
    stream.flush()


def make_progress_hooks(stream: IO[str] | None = None, *, force: bool = False) -> Hooks:
    """Rank-0 hooks drawing a bar of completed updates (with the latest loss) on ``stream``.

    ``stream`` defaults to stderr. The bar appears only when stdout and ``stream`` are TTYs and
    ``stream``'s terminal reports a width, unless ``force`` is true; otherwise this returns ``{}``.
    """
    out = stream if stream is not None else sys.stderr
    interactive = sys.stdout.isatty() and getattr(out, "isatty", lambda: False)()
    if not (force or (interactive and terminal_columns(out) > 0)):
        return {}
    tqdm = _import_tqdm()
    state: dict[str, Any] = {"bar": None}

    def on_train_start(info: dict[str, Any]) -> None:
        state["bar"] = tqdm(
            total=info.get("max_steps"),
            initial=info.get("step", 0),
            file=out,
            unit="step",
            dynamic_ncols=True,
        )

    def on_step_end(info: dict[str, Any]) -> None:
        if state["bar"] is not None:
            state["bar"].update(1)

    def on_log(info: dict[str, Any]) -> None:
        loss = info.get("metrics", {}).get("loss")
        if state["bar"] is not None and loss is not None:
            state["bar"].set_postfix(loss=f"{float(loss):.4g}", refresh=False)

    def close(info: dict[str, Any]) -> None:
        if state["bar"] is not None:
            state["bar"].close()
            state["bar"] = None

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_step_end": [rank0_only(on_step_end)],
        "on_log": [rank0_only(on_log)],
        "on_train_end": [rank0_only(close)],
        "on_exception": [rank0_only(close)],
    }

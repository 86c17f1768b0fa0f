"""The run's history across attempts: which attempt this is, what it resumed, how the last ended.

`begin_attempt` (the loop calls it once, before ``on_train_start``) builds the attempt record
every sink writes first (``info["attempt"]``): the attempt number, ``resumed_from`` (checkpoint
path and tier), how the previous attempt ended as far as its checkpoints and end record show it
(``finished``, ``stopped``, ``evacuated``, ``gpu_health``, ``failed``, ``crashed``) and the
steps this attempt redoes; and it says so in one line (a finished run: that there is nothing to
train). `make_history_hooks` keeps ``<out_dir>/attempts.jsonl`` (rank 0, one JSON object per
line, appended): a ``start`` line per attempt, a ``progress`` line per logged row (so a killed
attempt's last step is known) and an ``end`` line, and at the end of an attempt adds the run's
goodput to ``on_train_end``'s info (``info["run"]``): useful steps over the wall time since the
first attempt began, restarts and the gaps between attempts included.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from koochak.loop.console import announce
from koochak.loop.hooks import Hooks, rank0_only

__all__ = [
    "HISTORY_FILE",
    "begin_attempt",
    "format_duration",
    "make_history_hooks",
    "read_history",
]

HISTORY_FILE = "attempts.jsonl"
HISTORY_VERSION = 1
# A checkpoint's reason -> how the attempt that wrote it ended (periodic: it did not end there).
_ENDS = {"terminal": "finished", "stopped": "stopped", "evacuation": "evacuated",
         "gpu_health": "gpu_health"}  # fmt: skip


def history_path(out_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(out_dir), HISTORY_FILE)


def read_history(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``<out_dir>/attempts.jsonl`` (torn or foreign lines skipped; none: [])."""
    try:
        with open(history_path(out_dir), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:  # none yet (or unreadable): the history is for people, never fatal
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill
        if isinstance(record, dict) and record.get("version") == HISTORY_VERSION:
            records.append(record)
    return records


def format_duration(seconds: float | None) -> str:
    """``1:02:03`` / ``2:03`` / ``4.2 s``: a duration for people."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _tier_of(path: str | None, tiers: Sequence[Any]) -> int | None:
    if path is None:
        return None
    best: tuple[int, int] | None = None
    for index, location in enumerate(tiers):
        root = getattr(location, "location", None) or location
        try:
            root = os.fspath(root)
        except TypeError:
            root = str(root)
        root = str(root).rstrip("/")
        inside = root and (path == root or path.startswith(root + "/"))
        if inside and (best is None or len(root) > best[1]):
            best = (index, len(root))
    return best[0] if best is not None else (0 if len(tiers) == 1 else None)


def _previous(records: list[dict[str, Any]]) -> tuple[int, dict[str, Any] | None, int | None]:
    """(number of the last attempt, its end record, the last step it completed)."""
    last = 0
    for record in records:
        if record.get("event") == "start":
            last = max(last, int(record.get("attempt") or 0))
    end, done = None, None
    for record in records:
        if record.get("attempt") != last:
            continue
        if record.get("event") == "end":
            end = record
        if record.get("event") in ("progress", "end", "start") and record.get("step") is not None:
            done = max(done or 0, int(record["step"]))
    return last, end, done


def begin_attempt(
    out_dir: str | os.PathLike[str] | None,
    tiers: Sequence[Any],
    resume_path: str | None,
    checkpoint: Mapping[str, Any] | None,
    start_step: int,
    max_steps: int | None,
    rank: int = 0,
) -> dict[str, Any]:
    """This attempt's record (every rank gets one; rank 0 reads the history and says it)."""
    records = read_history(out_dir) if out_dir is not None and rank == 0 else []
    last, end, done = _previous(records)
    attempt = last + 1 if last else (2 if checkpoint is not None else 1)
    record: dict[str, Any] = {"attempt": attempt, "start_step": start_step,
                              "max_steps": max_steps, "time": time.time()}  # fmt: skip
    reason = str(checkpoint.get("reason", "periodic")) if checkpoint is not None else None
    if checkpoint is not None:
        record["resumed_from"] = resume_path
        tier = _tier_of(resume_path, tiers)
        if tier is not None:
            record["resumed_tier"] = tier
    previous = None
    if end is not None and end.get("reason") in ("failed", "gpu_health", "evacuated", "stopped"):
        previous = str(end["reason"])
    elif reason is not None:
        previous = _ENDS.get(reason, "crashed")
    elif last:
        previous = "crashed" if end is None else str(end.get("reason") or "crashed")
    if previous is not None:
        record["previous_end"] = previous
        completed = done if done is not None else start_step
        if end is not None and end.get("step") is not None:
            completed = int(end["step"])
        record["previous_step"] = max(completed, start_step)
        record["steps_redone"] = max(0, completed - start_step)
    finished = reason in ("terminal", "stopped") and (
        reason == "stopped" or (max_steps is not None and start_step >= max_steps)
    )
    record["nothing_to_train"] = finished
    record["note"] = _note(record, end, checkpoint, finished)
    if rank == 0 and (checkpoint is not None or last):
        announce(record["note"])
    return record


def _note(record: Mapping[str, Any], end: Mapping[str, Any] | None,
          checkpoint: Mapping[str, Any] | None, finished: bool) -> str:  # fmt: skip
    attempt, start = record["attempt"], record["start_step"]
    of = f" of {record['max_steps']}" if record.get("max_steps") is not None else ""
    if finished:
        why = "stopped by a hook" if record.get("previous_end") == "stopped" else "finished"
        return (f"the run already {why} at step {start}{of} ({record.get('resumed_from')} is its "
                "terminal checkpoint): nothing to train; raise train.max_steps to continue it, "
                "or start over with --resume none (resume='none')")  # fmt: skip
    if checkpoint is None:
        if not record.get("previous_end"):
            return f"attempt {attempt}: a fresh start at step 0{of}"
        return (f"attempt {attempt}: starting at step 0{of} without a checkpoint (the previous "
                f"attempt {_ended(record, end)})")  # fmt: skip
    tier = record.get("resumed_tier")
    where = f"{record.get('resumed_from')}" + (f" (tier {tier})" if tier is not None else "")
    redone = record.get("steps_redone", 0)
    return (f"attempt {attempt}: resuming from {where} at step {start}{of}; the previous attempt "
            f"{_ended(record, end)}; {redone} step(s) redone")  # fmt: skip


def _ended(record: Mapping[str, Any], end: Mapping[str, Any] | None) -> str:
    previous, step = record.get("previous_end"), record.get("previous_step")
    if previous == "failed":
        error = f" ({end['error']})" if end is not None and end.get("error") else ""
        return f"failed after step {step}{error}"
    if previous == "gpu_health":
        return f"stopped on a GPU health check after step {step}"
    if previous == "crashed":
        return f"crashed or was killed after step {step}"
    return f"{previous} after step {step}"


class _HistoryFile:
    """``attempts.jsonl``, held open from the first record to the attempt's end: a record is one
    ``write`` (the progress record of every logged row would otherwise pay a makedirs, an open
    and a close each time, tens of microseconds on a logging update). Each record is flushed
    whole, so a killed process leaves every record it wrote in the file."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.path = history_path(out_dir)
        self.broken = False
        self._file: Any = None

    def append(self, record: Mapping[str, Any]) -> None:
        if self.broken:
            return
        try:
            if self._file is None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open)
            self._file.write(json.dumps({"version": HISTORY_VERSION, **record}) + "\n")
            self._file.flush()
        except OSError as exc:
            self.broken = True  # the history is for people: the run does not depend on it
            self.close()
            announce(f"cannot write the run history {self.path} ({exc}); training goes on")

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def goodput(records: list[dict[str, Any]], step: int, wall_time: float | None,
            now: float) -> dict[str, Any]:  # fmt: skip
    """The run so far: attempts, useful steps, wall seconds since the first attempt began, their
    ratio, and the share of that wall time the checkpoint lineage's own training time is."""
    starts = [r for r in records if r.get("event") == "start"]
    # The run began at its latest fresh start (none resumed): a --resume none begins a new one.
    fresh = [i for i, r in enumerate(starts) if not r.get("resumed", r.get("resumed_from"))]
    starts = starts[fresh[-1]:] if fresh else starts
    first = min((float(r["time"]) for r in starts), default=now)
    first_step = int(starts[0].get("step") or 0) if starts else 0
    wall = max(now - first, 1e-9)
    useful = max(0, step - first_step)
    out = {"attempts": max(len(starts), 1),
           "useful_steps": useful, "wall_s": wall, "goodput_steps_per_s": useful / wall}  # fmt: skip
    if wall_time is not None:
        out["goodput"] = min(1.0, float(wall_time) / wall)
    return out


def make_history_hooks(
    out_dir: str | os.PathLike[str] | None, attempt: Mapping[str, Any]
) -> tuple[Hooks, Hooks]:
    """Rank-0 hooks keeping ``<out_dir>/attempts.jsonl`` and adding the goodput at the end:
    ``(first, last)``, to merge before and after the other hooks. The start record is written
    by ``last`` (after every ``on_train_start`` hook succeeded: a run refused there leaves no
    trace); the end's goodput by ``first`` (so the sinks see ``info["run"]``)."""
    if out_dir is None or attempt.get("nothing_to_train"):
        return {}, {}
    history = _HistoryFile(out_dir)
    number = attempt["attempt"]
    started: list[bool] = []

    def on_train_start(info: dict[str, Any]) -> None:
        started.append(True)
        history.append({"event": "start", "attempt": number, "time": attempt["time"],
                        "step": attempt["start_step"], "resumed": "resumed_from" in attempt,
                        "resumed_from": attempt.get("resumed_from"),
                        "resumed_tier": attempt.get("resumed_tier")})  # fmt: skip

    def on_log(info: dict[str, Any]) -> None:
        history.append({"event": "progress", "attempt": number, "time": time.time(),
                        "step": int(info["step"]) + 1})  # fmt: skip

    def end(step: int, reason: str, wall_time: float | None, error: str | None = None) -> Any:
        now = time.time()
        record = {"event": "end", "attempt": number, "time": now, "step": step,
                  "reason": reason, "wall_time": wall_time}  # fmt: skip
        if error:
            record["error"] = error
        history.append(record)
        history.close()  # the attempt's last record
        return goodput(read_history(out_dir), step, wall_time, now)

    def on_train_end(info: dict[str, Any]) -> None:
        checkpoint = info.get("checkpoint") or {}
        reason = {"evacuation": "evacuated", "stopped": "stopped"}.get(
            str(info.get("reason")), "finished"
        )
        step = int(info.get("step", 0))
        run = end(step, reason, checkpoint.get("wall_time"))
        run["note"] = (
            f"attempt {number} {reason} at step {step}: {run['useful_steps']} useful step(s) in "
            f"{format_duration(run['wall_s'])} of wall time over {run['attempts']} attempt(s), "
            f"restarts included ({run['goodput_steps_per_s']:.3g} steps/s"
            + (f"; goodput {run['goodput']:.0%}" if "goodput" in run else "") + ")"
        )
        info["run"] = run
        announce(run["note"])

    def on_exception(info: dict[str, Any]) -> None:
        from koochak.loop.health import GpuUnhealthy

        if not started:
            return  # refused before it started: not an attempt
        exc = info.get("exception")
        reason = "gpu_health" if isinstance(exc, GpuUnhealthy) else "failed"
        error = None
        if exc is not None:  # masked before it is cut, like every other line a run writes
            from koochak.loop.masking import mask_text

            error = mask_text(f"{type(exc).__name__}: {' '.join(str(exc).split())}")[:300]
        end(int(info.get("step", 0)), reason, None, error)

    first = {
        "on_log": [rank0_only(on_log)],
        "on_train_end": [rank0_only(on_train_end)],
        "on_exception": [rank0_only(on_exception)],
    }
    return first, {"on_train_start": [rank0_only(on_train_start)]}

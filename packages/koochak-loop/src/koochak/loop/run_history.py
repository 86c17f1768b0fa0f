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

The same file is the run's story for `koochak.loop.report`: each attempt's start (with the
hosts of its ranks, its Slurm job and ``train.init_from``'s origin), each checkpoint commit per
tier with its time, each replication with its lag, each prune, each resume selection (the tier
and step chosen, the candidates passed over and why), each older run's checkpoints a start over
moved aside (``supersede``) and each end, appended as they happen (docs/formats.md, "Run
history"). A line that is torn, of an unknown version or with a field of the wrong type is
skipped with one warning; it never stops a run or a report. A killed attempt writes no end:
the next one says how it ended as far as its records and Slurm show (`koochak.loop.slurm_facts`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

from koochak.loop.console import announce
from koochak.loop.hooks import Hooks, rank0_only

__all__ = [
    "HISTORY_FILE",
    "append_record",
    "begin_attempt",
    "record_resume_selection",
    "record_supersede",
    "format_duration",
    "make_history_hooks",
    "read_history",
]

HISTORY_FILE = "attempts.jsonl"
HISTORY_VERSION = 1  # start, progress, end (an older reader reads these)
EVENTS_VERSION = 2  # commit, replicate, prune, resume (an older reader skips these)
_VERSIONS = (HISTORY_VERSION, EVENTS_VERSION)
_NEWEST = max(_VERSIONS)
_ANY = object()
# The exact types JSON gives (so a bool is no int); a float must also be finite.
_INT, _NUM, _STR, _LIST, _MAP = (int,), (int, float), (str,), (list,), (dict,)
# field -> its type (None always allowed); a record with another is skipped as hostile or torn
_FIELDS: dict[str, Any] = {
    "attempt": _INT, "step": _INT, "time": _NUM, "event": _STR, "reason": _STR, "error": _STR,
    "resumed_from": _STR, "resumed_tier": _INT, "wall_time": _NUM, "tier": _INT, "path": _STR,
    "status": _STR, "lag_s": _NUM, "seconds": _NUM, "bytes": _INT, "host": _STR, "rank": _INT,
    "world_size": _INT, "exit_code": _INT, "slurm_job_id": _STR, "slurm_restarts": _INT,
    "hosts": _MAP, "previous": _MAP, "passed_over": _LIST, "steps": _LIST, "note": _STR,
    "origin": _MAP, "run_id": _STR,
}  # fmt: skip
_REQUIRED = {"start": ("step",), "progress": ("step",), "end": ("step",),
             "commit": ("tier", "step"), "replicate": ("tier",), "prune": ("tier", "steps"),
             "resume": (), "supersede": ("tier", "run_id", "path")}  # fmt: skip
# A checkpoint's reason -> how the attempt that wrote it ended (periodic: it did not end there).
_ENDS = {"terminal": "finished", "stopped": "stopped", "evacuation": "evacuated",
         "gpu_health": "gpu_health"}  # fmt: skip


def history_path(out_dir: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(out_dir), HISTORY_FILE)


def read_history(out_dir: str | os.PathLike[str], *, warn: bool = True) -> list[dict[str, Any]]:
    """The records of ``<out_dir>/attempts.jsonl`` (none: ``[]``). A torn or hostile line (not
    JSON, not an object, a field of the wrong type) and a line of a version this reader does
    not know are skipped, with one warning naming the file and the first such line."""
    path = history_path(out_dir)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:  # none yet (or unreadable): the history is for people, never fatal
        return []
    records, bad, newer, first = [], 0, 0, None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        version = record.get("version") if type(record) is dict else None
        if type(version) is int and version > _NEWEST:
            newer += 1  # a newer Koochak's: skipped, as its format promises
            continue
        if not _valid(record):
            bad += 1
            first = first or number
            continue
        records.append(record)
    if warn and (bad or newer):
        said = []
        if bad:
            said.append(f"{bad} torn or malformed line(s) skipped (the first: line {first})")
        if newer:
            said.append(f"{newer} line(s) of a newer history version skipped")
        announce(f"{path}: " + "; ".join(said), level=logging.WARNING)
    return records


def _valid(record: Any) -> bool:
    """A record of a known version whose every known field has its type."""
    if type(record) is not dict or type(record.get("version")) is not int:
        return False
    if record["version"] not in _VERSIONS or type(record.get("event")) is not str:
        return False
    for key, value in record.items():  # a record's own few keys, not every known one
        kind = _FIELDS.get(key)
        if kind is None or value is None:
            continue
        if type(value) not in kind or (type(value) is float and not math.isfinite(value)):
            return False
    if type(record.get("attempt")) is not int or record["attempt"] < 0:
        return False
    if record.get("time") is None:  # every record says when
        return False
    if record.get("step") is not None and record["step"] < 0:
        return False
    for key in _REQUIRED.get(record["event"], ()):  # noqa: SIM110 (no generator per record)
        if record.get(key) is None:
            return False
    return True


def append_record(out_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Append one record of `EVENTS_VERSION` to the history (open, append, close): for an event
    recorded outside an attempt's hooks (the resume selection, made before the loop starts).
    Never fatal: a history that cannot be written is said once and training goes on."""
    history = _HistoryFile(out_dir)
    history.append({"version": EVENTS_VERSION, **record})
    history.close()


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


def _previous(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last attempt's facts: ``number``, its ``start`` and ``end`` records, ``done`` (the
    last step it is known to have completed: its end's, else the highest it logged or
    committed) and ``exact`` (whether ``done`` is its end's, not a lower bound)."""
    last = 0
    for record in records:
        if record.get("event") == "start":
            last = max(last, int(record.get("attempt") or 0))
    facts: dict[str, Any] = {"number": last, "start": None, "end": None, "done": None,
                             "exact": False}  # fmt: skip
    for record in records:
        if record.get("attempt") != last:
            continue
        event, step = record.get("event"), record.get("step")
        if event == "start":
            facts["start"] = record
        if event == "end":
            facts["end"] = record
        if event in ("progress", "end", "start", "commit") and step is not None:
            facts["done"] = max(facts["done"] or 0, int(step))
    if facts["end"] is not None and facts["end"].get("step") is not None:
        facts["done"], facts["exact"] = int(facts["end"]["step"]), True
    return facts


def _number(last: int, resumed: bool) -> int:
    # A first attempt that resumes continues a run whose history began elsewhere (or was lost).
    return last + 1 if last else (2 if resumed else 1)


def _nothing_to_train(checkpoint: Mapping[str, Any] | None, max_steps: int | None) -> bool:
    """A run that already finished (or a hook stopped): resuming it trains nothing."""
    reason = str(checkpoint.get("reason", "periodic")) if checkpoint is not None else None
    start = int(checkpoint.get("next_step", 0)) if checkpoint is not None else 0
    return reason == "stopped" or (
        reason == "terminal" and max_steps is not None and start >= max_steps
    )


def record_resume_selection(
    out_dir: str | os.PathLike[str] | None,
    tiers: Sequence[Any],
    path: str | None,
    checkpoint: Mapping[str, Any] | None,
    passed: Sequence[Mapping[str, Any]],
    max_steps: int | None = None,
) -> None:
    """Append the resume selection (made before the attempt starts): the tier and step chosen
    (none: a fresh start) and each candidate passed over with why. Rank 0 only; nothing for a
    run with nothing left to train (which is no attempt)."""
    if out_dir is None or (checkpoint is None and not passed):
        return
    if _nothing_to_train(checkpoint, max_steps):
        return
    last = _previous(read_history(out_dir, warn=False))["number"]
    record: dict[str, Any] = {"event": "resume", "attempt": _number(last, checkpoint is not None),
                              "time": time.time(), "path": _masked(path),
                              "tier": _tier_of(path, tiers)}  # fmt: skip
    if checkpoint is not None:
        record["step"] = int(checkpoint.get("step", checkpoint.get("next_step", 0)))
    record["passed_over"] = [
        {"tier": p.get("tier"), "step": p.get("step"), "why": _masked(str(p.get("why")))[:300]}
        for p in passed
    ]
    append_record(out_dir, record)


def record_supersede(
    out_dir: str | os.PathLike[str] | None, tier: int, run_id: str, path: str, steps: Sequence[int]
) -> None:
    """Append that a run starting over (``--resume none``) moved the committed checkpoints of
    run ``run_id`` it found in tier ``tier`` (``steps``) aside to ``path`` (``superseded/...``),
    before its attempt starts (with that attempt's number). Rank 0 only; never fatal."""
    if out_dir is None:
        return
    last = _previous(read_history(out_dir, warn=False))["number"]
    append_record(out_dir, {"event": "supersede", "attempt": _number(last, False),
                            "time": time.time(), "tier": int(tier), "run_id": str(run_id),
                            "path": _masked(str(path)), "steps": [int(s) for s in steps]})  # fmt: skip


def _origin_of(info: Mapping[str, Any]) -> dict[str, Any] | None:
    """``train.init_from``'s origin as the start record keeps it (its path masked), or None."""
    origin = info.get("origin")
    if not isinstance(origin, Mapping) or not origin.get("path"):
        return None
    return {"path": _masked(str(origin["path"])), "sha256": str(origin.get("sha256") or ""),
            "ema": bool(origin.get("ema"))}  # fmt: skip


def _hosts(rank: int) -> dict[str, list[int]]:
    """``{host: [ranks]}`` of this attempt (a collective under DDP: every rank calls it)."""
    host = socket.gethostname()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            names: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(names, host)
            found: dict[str, list[int]] = {}
            for index, name in enumerate(names):
                found.setdefault(str(name), []).append(index)
            return found
    except (ImportError, RuntimeError):
        pass
    return {host: [rank]}


def _loss(previous: Mapping[str, Any]) -> dict[str, Any]:
    """How Slurm saw the previous attempt end, when its start named a job: ``requeued`` (times)
    and ``lost`` ({host: why}); ``{}`` without Slurm or without an answer."""
    start = previous.get("start") or {}
    job = start.get("slurm_job_id")
    if not job:
        return {}
    from koochak.loop import slurm_facts

    found: dict[str, Any] = {}
    facts = slurm_facts.job_facts(job)
    restarts = facts.get("restarts")
    if os.environ.get("SLURM_JOB_ID") == job:  # this attempt is that job, requeued
        restarts = max(restarts or 0, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    if restarts and restarts > int(start.get("slurm_restarts") or 0):
        found["requeued"] = restarts - int(start.get("slurm_restarts") or 0)
    if facts.get("state"):
        found["job_state"] = facts["state"]
    hosts = start.get("hosts") or {}
    if previous.get("end") is None or previous["end"].get("reason") == "failed":
        lost = slurm_facts.lost_nodes(sorted(hosts), float(start.get("time") or 0.0))
        if lost:
            found["lost"] = lost
    if found.get("lost") or found.get("requeued"):
        found["text"] = slurm_facts.describe_loss(hosts, found.get("lost", {}),
                                                  found.get("requeued"))  # fmt: skip
    return found


def begin_attempt(
    out_dir: str | os.PathLike[str] | None,
    tiers: Sequence[Any],
    resume_path: str | None,
    checkpoint: Mapping[str, Any] | None,
    start_step: int,
    max_steps: int | None,
    rank: int = 0,
) -> dict[str, Any]:
    """This attempt's record (every rank calls it: under DDP the ranks' hosts are gathered;
    rank 0 reads the history, asks Slurm about a previous attempt that left no end, and says it)."""
    hosts = _hosts(rank)
    records = read_history(out_dir) if out_dir is not None and rank == 0 else []
    previous = _previous(records)
    last, end = previous["number"], previous["end"]
    attempt = _number(last, checkpoint is not None)
    record: dict[str, Any] = {"attempt": attempt, "start_step": start_step,
                              "max_steps": max_steps, "time": time.time(), "hosts": hosts,
                              "world_size": sum(len(r) for r in hosts.values())}  # fmt: skip
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        record["slurm_restarts"] = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    reason = str(checkpoint.get("reason", "periodic")) if checkpoint is not None else None
    if checkpoint is not None:
        record["resumed_from"] = resume_path
        tier = _tier_of(resume_path, tiers)
        if tier is not None:
            record["resumed_tier"] = tier
    ended = None
    if end is not None and end.get("reason") in (*_ENDS.values(), "failed"):
        ended = str(end["reason"])
    elif reason is not None:
        ended = _ENDS.get(reason, "crashed")
    elif last:
        ended = "crashed" if end is None else str(end.get("reason") or "crashed")
    if ended is not None:
        loss = _loss(previous) if rank == 0 and last and ended in ("crashed", "failed") else {}
        if loss.get("lost"):
            ended = "node_lost"
        record["previous_end"] = ended
        if loss.get("text"):
            record["previous_failure"] = loss["text"]
        if loss.get("requeued"):
            record["previous_requeued"] = loss["requeued"]
        completed = previous["done"] if previous["done"] is not None else start_step
        record["previous_step"] = max(completed, start_step)
        record["steps_redone"] = max(0, completed - start_step)
        # Without an end record the last step is what it logged or committed: a lower bound.
        record["steps_redone_exact"] = bool(previous["exact"]) or not last
    finished = _nothing_to_train(checkpoint, max_steps)
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
    at_least = "" if record.get("steps_redone_exact", True) else "at least "
    return (f"attempt {attempt}: resuming from {where} at step {start}{of}; the previous attempt "
            f"{_ended(record, end)}; {at_least}{redone} step(s) redone")  # fmt: skip


def _ended(record: Mapping[str, Any], end: Mapping[str, Any] | None) -> str:
    previous, step = record.get("previous_end"), record.get("previous_step")
    after = f"after step {step}" if record.get("steps_redone_exact", True) else (
        f"after step {step} or later")  # fmt: skip
    if record.get("previous_failure"):
        return f"ended {after}: {record['previous_failure']}"
    if previous == "failed":
        error = f" ({end['error']})" if end is not None and end.get("error") else ""
        return f"failed {after}{error}"
    if previous == "gpu_health":
        return f"stopped on a GPU health check {after}"
    if previous == "crashed":
        return f"crashed or was killed {after}"
    return f"{previous} {after}"


# How an attempt ended -> koochak-train's exit code for it (koochak.loop.cli, launch).
_EXIT_CODES = {"finished": 0, "stopped": 0, "evacuated": 75, "failed": 1, "gpu_health": 79}
# The attempt record's keys about the previous attempt, kept in the start record's "previous".
_PREVIOUS = ("previous_end", "previous_step", "steps_redone", "steps_redone_exact",
             "previous_failure", "previous_requeued")  # fmt: skip


def _masked(text: str | None) -> str | None:
    """A path or message as the history may keep it (URL passwords, named secrets masked)."""
    if text is None:
        return None
    from koochak.loop.masking import mask_text

    return mask_text(text)


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
        record = {"event": "start", "attempt": number, "time": attempt["time"],
                  "step": attempt["start_step"], "resumed": "resumed_from" in attempt,
                  "resumed_from": _masked(attempt.get("resumed_from")),
                  "resumed_tier": attempt.get("resumed_tier"), "host": socket.gethostname(),
                  "hosts": attempt.get("hosts"), "world_size": attempt.get("world_size")}  # fmt: skip
        for key in ("slurm_job_id", "slurm_restarts"):
            if attempt.get(key) is not None:
                record[key] = attempt[key]
        origin = _origin_of(info)  # train.init_from: the weights this run started from
        if origin is not None:
            record["origin"] = origin
        previous = {key[len("previous_"):] if key.startswith("previous_") else key: attempt[key]
                    for key in _PREVIOUS if attempt.get(key) is not None}  # fmt: skip
        if previous:
            record["previous"] = previous
        history.append(record)

    committed: set[tuple[int, int]] = set()  # (tier, step) this attempt recorded

    def commit(tier: int, step: int, when: float, path: Any = None, **more: Any) -> None:
        if (tier, step) in committed:
            return
        committed.add((tier, step))
        history.append({"version": EVENTS_VERSION, "event": "commit", "attempt": number,
                        "time": when, "tier": tier, "step": step,
                        "path": _masked(str(path)) if path else None, **more})  # fmt: skip

    def on_checkpoint(info: dict[str, Any]) -> None:
        # Without replicas: the first tier's commit, as it happens. With them this names the
        # first replica, which on_replication records (with the first tier's commit time).
        if started and info.get("tier") in (None, 0) and info.get("step") is not None:
            commit(0, int(info["step"]), time.time(), info.get("path"))

    def on_replication(info: dict[str, Any]) -> None:
        if not started or info.get("step") is None:
            return
        at = info.get("at")
        now = float(at) if isinstance(at, (int, float)) else time.time()
        step, tier = int(info["step"]), int(info.get("tier") or 0)
        behind = info.get("behind_s")
        behind = float(behind) if isinstance(behind, (int, float)) else None
        record = {"version": EVENTS_VERSION, "event": "replicate", "attempt": number,
                  "time": now, "tier": tier, "step": step, "status": str(info.get("status")),
                  "lag_s": behind, "seconds": info.get("seconds")}  # fmt: skip
        if info.get("error"):
            record["error"] = _masked(str(info["error"]))[:300]
        status = info.get("status")
        if status == "published":  # the first tier's commit (the copies start from it)
            commit(0, step, now)
            return
        if status == "pruned":
            history.append({"version": EVENTS_VERSION, "event": "prune", "attempt": number,
                            "time": now, "tier": tier, "steps": [step]})  # fmt: skip
            return
        history.append(record)
        if status == "committed":
            if behind is not None:  # the first tier committed it `behind` seconds ago
                commit(0, step, now - behind, derived="replication")
            commit(tier, step, now, info.get("path"))

    on_checkpoint.never_stops = True  # type: ignore[attr-defined]  # see loop: ask_every_step

    def on_log(info: dict[str, Any]) -> None:
        history.append({"event": "progress", "attempt": number, "time": time.time(),
                        "step": int(info["step"]) + 1})  # fmt: skip

    def end(step: int, reason: str, wall_time: float | None, error: str | None = None) -> Any:
        now = time.time()
        record = {"event": "end", "attempt": number, "time": now, "step": step,
                  "reason": reason, "wall_time": wall_time, "host": socket.gethostname(),
                  "rank": 0, "exit_code": _EXIT_CODES.get(reason)}  # fmt: skip
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
        "on_checkpoint": [rank0_only(on_checkpoint)],
        "on_replication": [rank0_only(on_replication)],
    }
    return first, {"on_train_start": [rank0_only(on_train_start)]}

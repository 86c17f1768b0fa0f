"""Who is publishing a name: the intent record ``publish`` writes before the object.

``<name>.publishing.json`` (docs/formats.md) names the publishing process: its host, the host's
boot id, its pid namespace, its pid and the pid's start time, and the wall-clock deadline by which it will have
committed the name or given up. ``publish`` puts it create-only before the object and deletes it
after the manifest, so an object found without its manifest comes with the record of whoever put
it, and a later publish of the name removes that object only when the record proves its
publisher dead:

* on the same host: the host has booted since (another boot id), or — only within the same pid
  namespace — the pid is gone or is now another process (another start time). Two containers
  on one node share the hostname and boot id but not the pid namespace, where a pid names
  another process or none: a record from another namespace (or one that does not say, as
  version 1 records do not) can never be proven dead by its pid;
* on any host: the deadline has passed by more than ``CLOCK_SKEW_SECONDS`` (a live publisher
  never commits after its deadline: it fails instead).

Anything else is a live publisher, or one that cannot be proven dead: ``publish`` then fails
with FileExistsError naming it, and removes nothing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from functools import cache

from koochak.storage.strict_json import loads_strict, require_version

INTENT_SUFFIX = ".publishing.json"
INTENT_VERSION = 2
_READABLE = (1, 2)  # version 1 had no pid_ns: read as "", which proves nothing by pid
# How long a publication may take from its intent to its manifest before it must give up.
LEASE_SECONDS = 3600.0
# How far apart two hosts' clocks may be for a passed deadline to prove a publisher gone.
CLOCK_SKEW_SECONDS = 300.0

_FIELDS = {"version", "key", "host", "boot_id", "pid_ns", "pid", "pid_start", "deadline"}


@dataclass(frozen=True)
class Intent:
    key: str
    host: str
    boot_id: str  # "" where the host has none to offer (then only the deadline proves death)
    pid: int
    pid_start: int  # the pid's start time in clock ticks since boot; -1 where unknown
    deadline: float  # Unix seconds: committed or given up by then
    pid_ns: str = ""  # /proc/self/ns/pid, e.g. "pid:[4026531836]"; "" where unknown
    def to_bytes(self) -> bytes:
        doc = {"version": INTENT_VERSION, **asdict(self)}
        return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.deadline))
        return f"pid {self.pid} on {self.host} (committing by {when})"


def ours(key: str, lease: float | None = None) -> Intent:
    """The intent of this process to publish ``key`` within ``lease`` (LEASE_SECONDS) seconds."""
    lease = LEASE_SECONDS if lease is None else lease
    pid = os.getpid()
    return Intent(
        key=key,
        host=socket.gethostname(),
        boot_id=_boot_id(),
        pid_ns=_pid_ns(),
        pid=pid,
        pid_start=_start_ticks(pid),
        deadline=time.time() + lease,
    )


def parse(raw: bytes, where: str) -> Intent:
    """Read an intent record; ValueError naming ``where`` and the field when it is malformed."""
    doc = loads_strict(raw, where)
    version = require_version(doc, where, _READABLE)
    fields = _FIELDS if version >= 2 else _FIELDS - {"pid_ns"}
    if set(doc) != fields:
        extra = sorted(set(doc) - fields) or sorted(fields - set(doc))
        raise ValueError(f"{where}: unknown or missing field {extra[0]!r}")
    types = {"key": str, "host": str, "boot_id": str, "pid": int, "pid_start": int}
    if version >= 2:
        types["pid_ns"] = str
    for name, kind in types.items():
        if type(doc[name]) is not kind:
            raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}")
    if type(doc["deadline"]) not in (int, float):
        raise ValueError(f"{where}: field 'deadline' must be a number")
    doc.pop("version")
    return Intent(**doc)


def why_dead(intent: Intent, now: float | None = None) -> str | None:
    """Why ``intent``'s publisher is provably gone, or None when it may still be running."""
    now = time.time() if now is None else now
    if now > intent.deadline + CLOCK_SKEW_SECONDS:
        return "its deadline passed"
    if intent.host != socket.gethostname() or not intent.boot_id:
        return None
    if intent.boot_id != _boot_id():
        return "its host has rebooted since"
    if intent.pid_start < 0 or not intent.pid_ns or intent.pid_ns != _pid_ns():
        return None  # its pid names another process, or none, in our namespace: cannot tell
    if _start_ticks(intent.pid) != intent.pid_start:
        return f"pid {intent.pid} is no longer running"
    return None


@cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _pid_ns() -> str:
    """This process's pid namespace, as ``/proc/self/ns/pid`` names it; "" without /proc.

    Not cached: a child forked after ``unshare(CLONE_NEWPID)`` lives in another namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int:
    """The start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22); -1 when
    there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return -1

"""Who is publishing a name: the intent record ``publish`` writes before the object.

``<name>.publishing.json`` (docs/formats.md) names the publishing process: its host, the host's
boot id, its pid namespace, its pid and the pid's start time, and the wall-clock deadline by which it will have
committed the name or given up. ``publish`` puts it create-only before the object and deletes it
after the manifest, so an object found without its manifest comes with the record of whoever put
it, and a later publish of the name removes that object only when the record proves its
publisher dead:

* on the same machine: it has booted since (another boot id, and the record was written before
  this boot: ``from_before_this_boot``), or — only within the same pid
  namespace — the pid is gone or is now another process (another start time). The machine is
  told by its identity (``/etc/machine-id``, version 3 records), never by its hostname alone:
  two machines may share a hostname, and a record written after this host booted is never
  "from before a reboot", whatever its boot id says. Two containers
  on one node share the hostname and boot id but not the pid namespace, where a pid names
  another process or none: a record from another namespace (or one that does not say, as
  version 1 records do not) can never be proven dead by its pid;
* on any host: the deadline has passed by more than ``CLOCK_SKEW_SECONDS`` (a live publisher
  never commits after its deadline: it fails instead);
* by its Slurm job (``koochak.storage._slurm_job``, the optional ``slurm_*`` fields): an earlier
  attempt of this very job, requeued since, or a job ``squeue`` says ended.

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

from koochak.storage._slurm_job import SlurmJob, current, parse_fields, why_ended
from koochak.storage.strict_json import loads_strict, require_version

INTENT_SUFFIX = ".publishing.json"
INTENT_VERSION = 3
# Version 1 had no pid_ns (read as "", which proves nothing by pid); versions 1 and 2 had no
# machine_id and written (read as "" and -1: a reboot is then never proven, only the deadline).
_READABLE = (1, 2, 3)
# How long a publication may take from its intent to its manifest before it must give up.
LEASE_SECONDS = 3600.0
# How far apart two hosts' clocks may be for a passed deadline to prove a publisher gone.
CLOCK_SKEW_SECONDS = 300.0

_FIELDS = {"version", "key", "host", "boot_id", "pid_ns", "pid", "pid_start", "deadline",
           "machine_id", "written"}  # fmt: skip
_ADDED = {1: {"pid_ns", "machine_id", "written"}, 2: {"machine_id", "written"}, 3: set()}


@dataclass(frozen=True)
class Intent:
    key: str
    host: str
    boot_id: str  # "" where the host has none to offer (then only the deadline proves death)
    pid: int
    pid_start: int  # the pid's start time in clock ticks since boot; -1 where unknown
    deadline: float  # Unix seconds: committed or given up by then
    pid_ns: str = ""  # /proc/self/ns/pid, e.g. "pid:[4026531836]"; "" where unknown
    machine_id: str = ""  # /etc/machine-id; "" where unknown (then the hostname stands in)
    written: float = -1.0  # Unix seconds when it was written; -1 where unknown
    slurm: SlurmJob = SlurmJob()  # the publisher's Slurm job attempt; none outside Slurm
    # Not stored: the dead publisher whose intent this claim replaced ("" when the name was
    # free), so the claimant knows it may find that publisher's leftovers under the name.
    took_over: str = ""

    def to_bytes(self) -> bytes:
        doc = {"version": INTENT_VERSION, **asdict(self)}
        doc.pop("slurm")
        doc.pop("took_over")
        doc.update(self.slurm.fields())
        return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.deadline))
        job = f", {self.slurm.describe()}" if self.slurm.job_id else ""
        return f"pid {self.pid} on {self.host}{job} (committing by {when})"


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
        machine_id=_machine_id(),
        written=time.time(),
        slurm=current(),
    )


def parse(raw: bytes, where: str) -> Intent:
    """Read an intent record; ValueError naming ``where`` and the field when it is malformed."""
    doc = loads_strict(raw, where)
    version = require_version(doc, where, _READABLE)
    slurm = parse_fields(doc, where) if version >= 3 else SlurmJob()
    fields = _FIELDS - _ADDED[version]
    if set(doc) != fields:
        extra = sorted(set(doc) - fields) or sorted(fields - set(doc))
        raise ValueError(f"{where}: unknown or missing field {extra[0]!r}")
    types = {"key": str, "host": str, "boot_id": str, "pid": int, "pid_start": int,
             "pid_ns": str, "machine_id": str}  # fmt: skip
    for name, kind in types.items():
        if name in doc and type(doc[name]) is not kind:
            raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}")
    for name in ("deadline", "written"):
        if name in doc and type(doc[name]) not in (int, float):
            raise ValueError(f"{where}: field {name!r} must be a number")
    doc.pop("version")
    return Intent(**doc, slurm=slurm)


def why_dead(intent: Intent, now: float | None = None) -> str | None:
    """Why ``intent``'s publisher is provably gone, or None when it may still be running: by its
    deadline or machine (``_by_machine``), else by its Slurm job (``_slurm_job.why_ended``),
    unless its process is seen running here."""
    found = _by_machine(intent, now)
    if found is not None or running_here(intent.machine_id, intent.boot_id, intent.pid_ns,
                                         intent.pid, intent.pid_start):  # fmt: skip
        return found
    return why_ended(intent.slurm)


def _by_machine(intent: Intent, now: float | None) -> str | None:
    now = time.time() if now is None else now
    if now > intent.deadline + CLOCK_SKEW_SECONDS:
        return "its deadline passed"
    if not same_machine(intent.host, intent.machine_id) or not intent.boot_id:
        return None
    if intent.boot_id != _boot_id():
        if from_before_this_boot(intent.written):
            return "its host has rebooted since"
        return None  # another machine of this name (or identity), or a time we cannot place
    if intent.pid_start < 0 or not intent.pid_ns or intent.pid_ns != _pid_ns():
        return None  # its pid names another process, or none, in our namespace: cannot tell
    if _start_ticks(intent.pid) != intent.pid_start:
        return f"pid {intent.pid} is no longer running"
    return None


def running_here(machine_id: str, boot_id: str, pid_ns: str, pid: int, pid_start: int) -> bool:
    """Whether the process a record names is provably running now: this machine (by its
    identity), this boot, this pid namespace, and its pid started when the record says. No
    other evidence (a Slurm job said to be over) outweighs that."""
    same_boot = bool(machine_id) and machine_id == _machine_id() and boot_id == _boot_id()
    same_ns = same_boot and bool(pid_ns) and pid_ns == _pid_ns()
    return same_ns and pid_start >= 0 and _start_ticks(pid) == pid_start


def same_machine(host: str, machine_id: str) -> bool:
    """Whether a record from ``host`` with ``machine_id`` may be from this machine: by machine
    identity where the record has one, else by hostname (an older record)."""
    if machine_id:
        return machine_id == _machine_id()
    return host == socket.gethostname()


def from_before_this_boot(written: float | None) -> bool:
    """Whether a record written at ``written`` (Unix seconds; None or < 0: unknown) was written
    before this host's current boot. Unknown is never "before": a record is only ever proven
    dead by a reboot it provably predates."""
    boot = _boot_time()
    return written is not None and written >= 0 and boot is not None and written < boot


@cache
def _machine_id() -> str:
    """This machine's identity (``/etc/machine-id``, else D-Bus's copy); "" where it has none."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as handle:
                found = handle.read().strip()
        except OSError:
            continue
        if found:
            return found
    return ""


@cache
def _boot_time() -> float | None:
    """When this host booted (Unix seconds, /proc/stat's btime); None without /proc."""
    try:
        with open("/proc/stat") as handle:
            for line in handle:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
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

"""One live holder per location: a lease object, built on create-only put and delete only.

``acquire_lease(store)`` puts ``koochak-run.lease.json`` (docs/formats.md) create-only: who
holds it (host, boot id, pid namespace, pid and the pid's start time), since when, and for how
long it stays valid without renewal (``ttl_seconds``). While the holder lives it renews the lease
every ``renew_seconds`` by putting a small renewal object (``<key>.renewed-<token>-<n>.json``, beside it)
and deleting the one before, so the lease itself is never rewritten: any Store can hold it — a
directory, an object-storage mount (exclusive mode) or S3 (conditional writes).

A second acquirer finds the object and is refused (``LeaseHeld``, naming the holder) unless the
holder is provably gone:

* on the same machine (told by ``/etc/machine-id``, not by hostname: version 2 records): the
  machine has booted since (another boot id) and the holder's last renewal predates this boot,
  or — in the same pid namespace — its pid is gone or is another process (another start time).
  A record from another machine, or renewed after this host booted, is alive until its ttl;
* on any host: its last renewal is older than ``ttl_seconds`` plus ``CLOCK_SKEW_SECONDS`` (a
  live holder renews far more often than that), so a dead holder elsewhere is taken over at most
  ``ttl_seconds + CLOCK_SKEW_SECONDS`` (15 minutes by default) after its last renewal;
* by its Slurm job (``koochak.storage._slurm_job``): the record names an earlier attempt of
  this very job (Slurm requeued it since), or a job that ``squeue`` says ended, so a requeued
  job takes over its own lost node's lease at once instead of after those 15 minutes.

A gone holder's lease is taken over with one warning. Two acquirers that both find it gone race
for a takeover marker (``<key>.takeover-<token>``, create-only), so only one deletes it.

A holder learns that it lost the lease (``Lease.lost``, ``Lease.lost_reason``) when a renewal
finds another lease in its place, or once its renewals have failed for ``ttl_seconds``: from
then on it must stop writing (koochak-loop stops the run before its next checkpoint publish).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from koochak.storage._publish_intent import (
    CLOCK_SKEW_SECONDS,
    _boot_id,
    _machine_id,
    _pid_ns,
    _start_ticks,
    from_before_this_boot,
    running_here,
    same_machine,
)
from koochak.storage._slurm_job import SlurmJob, current, parse_fields, why_ended
from koochak.storage.protocol import Store, capabilities_of
from koochak.storage.strict_json import loads_strict, require_version

__all__ = [
    "LEASE_KEY",
    "LEASE_VERSION",
    "Lease",
    "LeaseHeld",
    "LeaseRecord",
    "acquire_lease",
    "read_lease",
    "why_gone",
]

LEASE_KEY = "koochak-run.lease.json"
LEASE_VERSION = 2
_READABLE = (1, 2)  # version 1 had no machine_id (read as "": the hostname stands in)
TTL_SECONDS = 600.0
RENEW_SECONDS = 60.0

_log = logging.getLogger(__name__)
_FIELDS = {"version", "token", "host", "boot_id", "pid_ns", "pid", "pid_start", "started",
           "ttl_seconds", "purpose", "machine_id"}  # fmt: skip
_ACTIVE: set[str] = set()  # tokens this process holds now (a leftover of ours is not active)


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds a lease: the content of the lease object (and of a takeover marker)."""

    token: str
    host: str
    boot_id: str
    pid_ns: str
    pid: int
    pid_start: int
    started: float  # Unix seconds
    ttl_seconds: float
    purpose: str = ""
    machine_id: str = ""  # /etc/machine-id; "" where unknown (then the hostname stands in)
    slurm: SlurmJob = SlurmJob()  # the holder's Slurm job attempt; none outside Slurm

    def to_bytes(self) -> bytes:
        doc = {"version": LEASE_VERSION, **asdict(self)}
        doc.pop("slurm")
        doc.update(self.slurm.fields())
        return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        what = f" ({self.purpose})" if self.purpose else ""
        job = f", {self.slurm.describe()}" if self.slurm.job_id else ""
        return f"pid {self.pid} on {self.host}{what}{job}, since {when}"


class LeaseHeld(FileExistsError):
    """Another live holder has the lease; ``holder`` is its record (None when unreadable)."""

    def __init__(self, message: str, where: str, holder: LeaseRecord | None) -> None:
        super().__init__(errno.EEXIST, message, where)
        self.holder = holder

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _ours(ttl_seconds: float, purpose: str) -> LeaseRecord:
    pid = os.getpid()
    return LeaseRecord(
        token=uuid.uuid4().hex,
        host=socket.gethostname(),
        boot_id=_boot_id(),
        pid_ns=_pid_ns(),
        pid=pid,
        pid_start=_start_ticks(pid),
        started=time.time(),
        ttl_seconds=float(ttl_seconds),
        purpose=purpose,
        machine_id=_machine_id(),
        slurm=current(),
    )


def _parse(raw: bytes, where: str) -> LeaseRecord:
    doc = loads_strict(raw, where)
    version = require_version(doc, where, _READABLE)
    slurm = parse_fields(doc, where) if version >= 2 else SlurmJob()
    fields = _FIELDS if version >= 2 else _FIELDS - {"machine_id"}
    if set(doc) != fields:
        extra = sorted(set(doc) - fields) or sorted(fields - set(doc))
        raise ValueError(f"{where}: unknown or missing field {extra[0]!r}")
    kinds = {"token": str, "host": str, "boot_id": str, "pid_ns": str, "pid": int,
             "pid_start": int, "purpose": str, "machine_id": str}  # fmt: skip
    for name, kind in kinds.items():
        if name in doc and type(doc[name]) is not kind:
            raise ValueError(f"{where}: field {name!r} must be a {kind.__name__}")
    for name in ("started", "ttl_seconds"):
        if type(doc[name]) not in (int, float) or doc[name] < 0:
            raise ValueError(f"{where}: field {name!r} must be a number >= 0")
    doc.pop("version")
    return LeaseRecord(**doc, slurm=slurm)


def read_lease(store: Store, key: str = LEASE_KEY) -> LeaseRecord | None:
    """The lease at ``key``, or None when there is none; ValueError when it is malformed."""
    try:
        raw = store.get(key)
    except FileNotFoundError:
        return None
    return _parse(raw, f"{store.location}/{key}")


def _renewal_prefix(key: str, token: str) -> str:
    return f"{key}.renewed-{token}-"


def _last_renewed(store: Store, key: str, record: LeaseRecord) -> float | None:
    """When ``record``'s holder last renewed (its start if never); None when that cannot be
    read (a renewal replaced while we looked, three times): then it counts as just renewed."""
    prefix = _renewal_prefix(key, record.token)
    for _ in range(3):
        found = store.list(prefix)
        if not found:
            return record.started
        try:
            doc = loads_strict(store.get(found[-1].key), f"{store.location}/{found[-1].key}")
        except FileNotFoundError:
            continue  # renewed meanwhile: look again
        except ValueError:
            return None
        renewed = doc.get("renewed") if isinstance(doc, dict) else None
        if type(renewed) not in (int, float):
            return None
        return max(record.started, float(renewed))
    return None


def why_gone(store: Store, key: str, record: LeaseRecord, now: float | None = None) -> str | None:
    """Why ``record``'s holder is provably gone, or None while it may still be running: by its
    machine (``_by_machine``), else by its Slurm job (``koochak.storage._slurm_job``), unless
    its process is seen running here."""
    if record.token in _ACTIVE:
        return None  # held by this very process, now
    found = _by_machine(store, key, record, now)
    if found is not None or running_here(record.machine_id, record.boot_id, record.pid_ns,
                                         record.pid, record.pid_start):  # fmt: skip
        return found
    return why_ended(record.slurm)


def _by_machine(store: Store, key: str, record: LeaseRecord, now: float | None) -> str | None:
    now = time.time() if now is None else now
    renewed = _last_renewed(store, key, record)
    if same_machine(record.host, record.machine_id) and record.boot_id:
        if record.boot_id != _boot_id():
            # Provably this machine before its reboot only when it was last renewed before
            # this boot; else another machine of this name, alive until its ttl.
            if renewed is not None and from_before_this_boot(renewed):
                return "its host has rebooted since"
            return _expired(record, renewed, now)
        same_ns = bool(record.pid_ns) and record.pid_ns == _pid_ns()
        if same_ns and record.pid_start >= 0 and _start_ticks(record.pid) != record.pid_start:
            return f"pid {record.pid} is no longer running"
        if same_ns and record.pid == os.getpid() and record.pid_start == _start_ticks(os.getpid()):
            return "this process left it behind"  # ours, but not held now
    return _expired(record, renewed, now)


def _expired(record: LeaseRecord, renewed: float | None, now: float) -> str | None:
    if renewed is not None and now > renewed + record.ttl_seconds + CLOCK_SKEW_SECONDS:
        return (
            f"it was last renewed {now - renewed:.0f} s ago (it expires "
            f"{record.ttl_seconds + CLOCK_SKEW_SECONDS:.0f} s after a renewal)"
        )
    return None


class Lease:
    """A lease this process holds. ``keep_renewed()`` renews it on a daemon thread until
    ``release()`` (also a context manager). ``lost`` (and ``lost_reason``, one line) says that the
    holder must stop writing: someone took the lease over, or it went unrenewed for
    ``ttl_seconds``, after which another holder may take it over. Once lost it stays lost."""

    def __init__(
        self,
        store: Store,
        key: str,
        record: LeaseRecord,
        renew_seconds: float,
        created: str | None = None,
    ) -> None:
        self.store, self.key, self.record = store, key, record
        self._created = created  # the store's root directory, when taking the lease made it
        self.renew_seconds = float(renew_seconds)
        self._lost_reason: str | None = None
        self._renewed_at = time.monotonic()  # the last renewal that reached the store
        self._renew_error = ""
        self._seq = 0
        self._renewal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"{self.store.location}/{self.key}"

    @property
    def lost_reason(self) -> str | None:
        """Why this holder must stop writing (None while the lease is its own)."""
        if self._lost_reason is None:
            unrenewed = time.monotonic() - self._renewed_at
            if unrenewed > self.record.ttl_seconds:
                error = f"; the last error: {self._renew_error}" if self._renew_error else ""
                self._lost_reason = (
                    f"it could not be renewed for {unrenewed:.0f} s, past its ttl_seconds="
                    f"{self.record.ttl_seconds:g}, so another run may take it over{error}"
                )
        return self._lost_reason

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def renew(self) -> None:
        """Record that the holder is alive now; say so once if the lease was taken over."""
        with self._lock:
            if self.lost:
                return  # lost for good: renewing now could hide a takeover in between
            try:
                current = read_lease(self.store, self.key)
            except ValueError:
                current = None
            if current is None or current.token != self.record.token:
                who = current.describe() if current is not None else "nobody (removed)"
                _log.error("%s: this run's lease was taken over; it is now held by %s",
                           self.where, who)  # fmt: skip
                self._lost_reason = (
                    f"it was taken over and is now held by {who}"
                    if current is not None
                    else "it was removed (by another run taking it over, or by hand)"
                )
                return
            self._seq += 1
            key = f"{_renewal_prefix(self.key, self.record.token)}{self._seq:09d}.json"
            body = json.dumps({"version": 1, "token": self.record.token, "renewed": time.time()})
            self.store.put(key, body.encode("utf-8"))
            self._renewed_at = time.monotonic()
            previous, self._renewal = self._renewal, key
            if previous is not None:
                _delete_quietly(self.store, previous)

    def keep_renewed(self) -> Lease:
        """Renew every ``renew_seconds`` on a daemon thread; returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="koochak-lease", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.renew_seconds):
            try:
                self.renew()
            except Exception as exc:  # a storage hiccup: the next renewal may work
                self._renew_error = " ".join(str(exc).split()) or type(exc).__name__
                _log.warning("%s: could not renew the lease: %s", self.where, exc)

    def release(self) -> None:
        """Stop renewing and remove the lease (only if it is still ours)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._lock:
            _ACTIVE.discard(self.record.token)
            try:
                current = read_lease(self.store, self.key)
            except (OSError, ValueError):
                current = None
            if current is not None and current.token == self.record.token:
                _delete_quietly(self.store, self.key)
            for info in _list_quietly(self.store, _renewal_prefix(self.key, self.record.token)):
                _delete_quietly(self.store, info.key)
            if self._created is not None:  # a run that wrote nothing leaves nothing behind
                try:
                    os.rmdir(self._created)
                except OSError:
                    pass  # not empty: the run wrote there

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def acquire_lease(
    store: Store,
    key: str = LEASE_KEY,
    *,
    ttl_seconds: float = TTL_SECONDS,
    renew_seconds: float = RENEW_SECONDS,
    purpose: str = "",
) -> Lease:
    """Take the lease at ``key`` in ``store``; ``LeaseHeld`` naming the holder while another
    live holder has it. A provably gone holder's lease is taken over with one warning.

    Call ``keep_renewed()`` on the result for a holder that lives longer than ``ttl_seconds``.
    """
    for name, value in (("ttl_seconds", ttl_seconds), ("renew_seconds", renew_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"acquire_lease: {name} must be a number > 0, got {value!r}")
    if renew_seconds * 2 > ttl_seconds:
        raise ValueError(
            f"acquire_lease: renew_seconds={renew_seconds} must be at most half of "
            f"ttl_seconds={ttl_seconds}, or a live holder's lease could expire"
        )
    where = f"{store.location}/{key}"
    ours = _ours(ttl_seconds, purpose)
    root = capabilities_of(store).root
    created = root if root is not None and "/" not in key and not os.path.isdir(root) else None
    for attempt in range(5):
        if attempt:
            time.sleep(0.05 * attempt)  # another acquirer is mid-takeover: let it finish
        try:
            store.put(key, ours.to_bytes())
        except FileExistsError:
            pass
        else:
            _ACTIVE.add(ours.token)
            return Lease(store, key, ours, renew_seconds, created)
        try:
            holder = read_lease(store, key)
        except ValueError as exc:
            raise LeaseHeld(
                f"held by a run whose lease is unreadable ({exc}); remove it once no run uses "
                "this location",
                where,
                None,
            ) from None
        if holder is None:
            continue  # released meanwhile: try again
        why = why_gone(store, key, holder)
        if why is None:
            raise LeaseHeld(
                f"another run holds this location: {holder.describe()}; stop it first (its "
                f"lease expires {holder.ttl_seconds + CLOCK_SKEW_SECONDS:.0f} s after its last "
                "renewal if it died on another host)",
                where,
                holder,
            )
        if _take_over(store, key, holder, ours):
            _log.warning("%s: taking over the lease of %s: %s", where, holder.describe(), why)
    raise LeaseHeld("others keep taking this lease; try again", where, None)


def _take_over(store: Store, key: str, holder: LeaseRecord, ours: LeaseRecord) -> bool:
    """Remove ``holder``'s lease if we win its takeover marker; True when we removed it."""
    marker = f"{key}.takeover-{holder.token}"
    try:
        store.put(marker, ours.to_bytes())
    except FileExistsError:
        try:
            taker = _parse(store.get(marker), f"{store.location}/{marker}")
        except (OSError, ValueError):
            return False
        if why_gone(store, marker, taker) is not None:  # a taker that died mid-takeover
            _delete_quietly(store, marker)
        return False
    try:
        current = read_lease(store, key)
        if current is None or current.token != holder.token:
            return False  # someone else finished that takeover, or it was released
        store.delete(key)
        for info in _list_quietly(store, _renewal_prefix(key, holder.token)):
            _delete_quietly(store, info.key)
        return True
    except (FileNotFoundError, ValueError):
        return False
    finally:
        _delete_quietly(store, marker)


def _delete_quietly(store: Store, key: str) -> None:
    try:
        store.delete(key)
    except OSError:
        pass


def _list_quietly(store: Store, prefix: str) -> list:
    try:
        return store.list(prefix)
    except OSError:
        return []

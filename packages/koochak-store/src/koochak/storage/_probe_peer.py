"""Cross-client checks for the storage probe: what a second view of the same storage sees.

One client cannot tell how long other nodes take to see its objects, whether ``O_EXCL`` holds
between clients, or whether ``fsync`` put the bytes on the server: its own mount answers from its
own caches. With ``--peer`` (another mount of the same bucket, the same directory on another
path, or any ``open_store`` location of it) the probe writes on one side and watches the other.

Every timed check runs ``rounds`` times; a delay is measured from ``close()`` (or ``fsync()``) to
the start of the first look that found the object whole, so the latency of the look itself is
not counted, and the report gives the median and the maximum.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from koochak.storage._probe_semantics import Check, errno_text, write_all
from koochak.storage.store import SETTLING_ERRNOS, Store, capabilities_of, open_store

_PAYLOAD_BYTES = 1 << 16
_RENAME_BYTES = 8 << 20  # large enough that a mount uploading it takes a while


class PeerView:
    """The probe's scratch directory as the peer sees it: ``size``, ``names``, ``create``, ``read``.

    ``root`` is a path (another mount point of the same storage) or a Store (any other location
    ``open_store`` resolves); ``name`` is the scratch directory's name under both.
    """

    def __init__(self, peer: str | os.PathLike[str] | Store, name: str) -> None:
        self.store: Store | None = None
        self.path: Path | None = None
        text = os.fspath(peer) if isinstance(peer, (str, os.PathLike)) else None
        if text is not None and "://" not in text:
            self.path = Path(text).expanduser().absolute() / name
        else:
            store = open_store(peer)  # type: ignore[arg-type]
            root = capabilities_of(store).root
            if root is not None:
                self.path = Path(root) / name
            else:
                self.store = store
        self.name = name
        self.location = str(self.path) if self.path is not None else f"{self.store.location}/{name}"  # type: ignore[union-attr]

    def size(self, rel: str) -> int | None:
        """The peer's size of ``rel``, or None when the peer does not (yet) see it."""
        try:
            if self.path is not None:
                return os.stat(self.path / rel).st_size
            return self.store.stat(f"{self.name}/{rel}").size  # type: ignore[union-attr]
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in SETTLING_ERRNOS:
                return None
            raise

    def names(self, rel_dir: str) -> set[str]:
        """Names the peer lists directly under ``rel_dir``."""
        if self.path is not None:
            try:
                return set(os.listdir(self.path / rel_dir))
            except FileNotFoundError:
                return set()
        prefix = f"{self.name}/{rel_dir}/"
        return {
            info.key[len(prefix) :].split("/")[0]
            for info in self.store.list(prefix)  # type: ignore[union-attr]
        }

    def create(self, rel: str, data: bytes) -> None:
        """Create ``rel`` create-only through the peer (FileExistsError when it exists)."""
        if self.path is not None:
            path = self.path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        else:
            self.store.put(f"{self.name}/{rel}", data)  # type: ignore[union-attr]

    def read(self, rel: str) -> bytes:
        if self.path is not None:
            return (self.path / rel).read_bytes()
        return self.store.get(f"{self.name}/{rel}")  # type: ignore[union-attr]


@dataclass(frozen=True)
class _Delays:
    """Seconds until the peer saw each round's object; None for a round where it never did."""

    values: tuple[float | None, ...]

    @property
    def seen(self) -> list[float]:
        return [v for v in self.values if v is not None]

    def summary(self) -> str:
        seen = self.seen
        if not seen:
            return "never"
        text = f"median {statistics.median(seen):.2f} s, max {max(seen):.2f} s"
        missed = len(self.values) - len(seen)
        return text + (f"; not seen in {missed} of {len(self.values)} rounds" if missed else "")


def _watch(look: Callable[[], bool], since: float, timeout: float) -> float | None:
    """Seconds from ``since`` to the start of the first ``look()`` that returned True."""
    while True:
        started = time.monotonic()
        if look():
            return max(0.0, started - since)
        if started - since > timeout:
            return None
        time.sleep(0.02)


def _write_closed(path: Path, data: bytes) -> float:
    """Create, write, fsync and close ``path``; return the monotonic time of the close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.monotonic()


def check_visibility(
    work: Path, peer: PeerView, rel_dir: str, rounds: int, timeout: float
) -> tuple[Check, Check]:
    """How long after close() the peer finds a new object (stat), and lists it."""
    stat_delays, list_delays = [], []
    for round_ in range(rounds):
        name = f"visible-{round_}"
        data = os.urandom(_PAYLOAD_BYTES)
        peer.size(f"{rel_dir}/{name}")  # the peer has looked and found nothing, as a reader would
        closed = _write_closed(work / name, data)
        stat_delays.append(
            _watch(lambda n=name: peer.size(f"{rel_dir}/{n}") == _PAYLOAD_BYTES, closed, timeout)
        )
        list_delays.append(_watch(lambda n=name: n in peer.names(rel_dir), closed, timeout))
    stat, listing = _Delays(tuple(stat_delays)), _Delays(tuple(list_delays))
    return (
        Check(
            "peer_sees_new_objects",
            len(stat.seen) == rounds,
            f"the peer finds a closed object after: {stat.summary()} ({rounds} rounds)",
            max(stat.seen) if stat.seen else None,
        ),
        Check(
            "peer_lists_new_objects",
            len(listing.seen) == rounds,
            f"the peer lists a closed object after: {listing.summary()} ({rounds} rounds)",
            max(listing.seen) if listing.seen else None,
        ),
    )


def check_reverse_visibility(
    work: Path, peer: PeerView, rel_dir: str, rounds: int, timeout: float
) -> Check:
    """How long after the peer wrote an object this client finds it."""
    delays = []
    for round_ in range(rounds):
        name = f"from-peer-{round_}"
        data = os.urandom(_PAYLOAD_BYTES)
        os.path.exists(work / name)  # this client looks first and finds nothing
        try:
            peer.create(f"{rel_dir}/{name}", data)
        except OSError as exc:
            return Check("new_objects_from_peer", None, f"the peer cannot write: {errno_text(exc)}")
        written = time.monotonic()
        delays.append(
            _watch(lambda n=name: _size_here(work / n) == _PAYLOAD_BYTES, written, timeout)
        )
    found = _Delays(tuple(delays))
    return Check(
        "new_objects_from_peer",
        len(found.seen) == rounds,
        f"an object the peer wrote is found here after: {found.summary()} ({rounds} rounds)",
        max(found.seen) if found.seen else None,
    )


def _size_here(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def check_exclusive_across_clients(work: Path, peer: PeerView, rel_dir: str, rounds: int) -> Check:
    """Right after one side created a name, may the other side still create it too?

    Both sides first look the name up, as two writers that both found it free a moment ago
    would: a mount that answers from a directory cache it refreshed then (rclone's
    ``--dir-cache-time``) creates the name again, one that asks the server each time refuses it.
    Without the look-up the outcome hung on whether that cache had just expired, so reruns
    disagreed. Every round tries both orders; one double create in any round is the answer.
    """
    outcomes = []
    for round_ in range(rounds):
        for first in ("here", "peer"):
            name = f"exclusive-{first}-first-{round_}"
            os.path.lexists(work / name)  # both writers check that the name is free
            peer.size(f"{rel_dir}/{name}")
            try:
                if first == "here":
                    _write_closed(work / name, b"here")
                    peer.create(f"{rel_dir}/{name}", b"peer")
                else:
                    peer.create(f"{rel_dir}/{name}", b"peer")
                    fd = os.open(work / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                    os.close(fd)
                outcomes.append(f"created by {first} and then by the other side too")
            except FileExistsError:
                continue
            except OSError as exc:
                return Check(
                    "exclusive_create_across_clients", None, f"could not try: {errno_text(exc)}"
                )
    if outcomes:
        return Check(
            "exclusive_create_across_clients",
            False,
            f"{outcomes[0]} ({len(outcomes)} of {2 * rounds} tries): create-only does not hold "
            "between clients",
        )
    return Check(
        "exclusive_create_across_clients",
        True,
        f"a name just created on one side is refused on the other ({2 * rounds} tries)",
    )


def check_fsync_reaches_server(
    work: Path, peer: PeerView, rel_dir: str, wait: float, timeout: float
) -> Check:
    """Does the peer see an fsynced file before it is closed, and when after the close?"""
    name = "durable"
    data = os.urandom(_PAYLOAD_BYTES)
    fd = os.open(work / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        try:
            os.fsync(fd)
        except OSError as exc:
            return Check("fsync_reaches_server", False, f"fsync fails: {errno_text(exc)}")
        synced = time.monotonic()
        early = _watch(lambda: peer.size(f"{rel_dir}/{name}") == len(data), synced, wait)
    finally:
        os.close(fd)
    closed = time.monotonic()
    if early is not None:
        return Check(
            "fsync_reaches_server",
            True,
            f"the peer saw the fsynced file {early:.2f} s later, before it was closed",
            early,
        )
    later = _watch(lambda: peer.size(f"{rel_dir}/{name}") == len(data), closed, timeout)
    seen = "never" if later is None else f"{later:.2f} s after close"
    return Check(
        "fsync_reaches_server",
        False,
        f"not seen by the peer within {wait:.1f} s of fsync while open; then {seen} "
        "(a mount that uploads on close, or later)",
        later,
    )


def check_rename_whole(work: Path, peer: PeerView, rel_dir: str, timeout: float) -> Check:
    """While a written file is renamed into place, does the peer ever see part of it there?"""
    data = os.urandom(_RENAME_BYTES)
    temp, final = work / ".rename-temp", work / "renamed"
    try:
        _write_closed(temp, data)
    except OSError as exc:
        return Check("rename_whole_across_clients", None, f"cannot write: {errno_text(exc)}")
    sizes: set[int | None] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            sizes.add(peer.size(f"{rel_dir}/renamed"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        os.rename(temp, final)
    except OSError as exc:
        stop.set()
        watcher.join()
        return Check("rename_whole_across_clients", False, f"rename fails: {errno_text(exc)}")
    renamed = time.monotonic()
    seen = _watch(lambda: peer.size(f"{rel_dir}/renamed") == len(data), renamed, timeout)
    stop.set()
    watcher.join()
    partial = sorted(s for s in sizes if s is not None and s != len(data))
    if partial:
        return Check(
            "rename_whole_across_clients",
            False,
            f"the peer saw the renamed name with {partial[0]} of {len(data)} bytes",
        )
    if seen is None:
        return Check(
            "rename_whole_across_clients",
            None,
            f"the peer never saw the renamed file ({timeout:.0f} s)",
        )
    return Check(
        "rename_whole_across_clients",
        True,
        f"the peer only ever saw the renamed name whole ({seen:.2f} s after the rename)",
        seen,
    )


def run_peer_checks(
    work: Path, peer: PeerView, rel_dir: str, rounds: int, timeout: float
) -> list[Check]:
    """Every cross-client check; ``work`` is ``rel_dir`` of the scratch directory seen here."""
    stat, listing = check_visibility(work, peer, rel_dir, rounds, timeout)
    checks = [stat, listing, check_reverse_visibility(work, peer, rel_dir, rounds, timeout)]
    checks.append(check_exclusive_across_clients(work, peer, rel_dir, rounds))
    # Long enough that a peer which caches still sees an fsynced object before close.
    wait = (stat.seconds or 0.0) + 1.0
    checks.append(check_fsync_reaches_server(work, peer, rel_dir, wait, timeout))
    checks.append(check_rename_whole(work, peer, rel_dir, timeout))
    return checks


def unreachable(work: Path, peer: PeerView, rel_dir: str, timeout: float) -> str | None:
    """Why the peer does not see what is written here (another bucket or path?), or None."""
    data = b"koochak-probe peer marker\n"
    _write_closed(work / "marker", data)
    try:
        seen = _watch(
            lambda: peer.size(f"{rel_dir}/marker") == len(data), time.monotonic(), timeout
        )
    except OSError as exc:
        return f"{peer.location}: {errno_text(exc)}"
    if seen is None:
        return (
            f"{peer.location} does not show an object written here within {timeout:.0f} s: "
            "--peer must be another view of the same storage as the location"
        )
    return None

"""Filesystem-semantics checks for the storage probe, done with plain ``os`` calls.

Each check runs in its own scratch subdirectory and returns a :class:`Check`. A check never
raises for what it is testing: an ``OSError`` from the operation under test means "not
supported" and is recorded with its errno name. From the checks, :func:`recommend_settings`
derives the LocalStore settings that are safe on this filesystem.
"""

from __future__ import annotations

import errno
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from koochak.storage.store import SETTLING_ERRNOS

_PAYLOAD = b"koochak-probe\n" * 293  # 4102 bytes: not a block multiple, so sizes are exact
# A delay this short is the poll's own granularity: the object was there at the first look.
_AT_ONCE = 0.05
# Recommended waits are rounded up to one of these (seconds), so small differences between runs
# of the probe do not change its advice.
_WAIT_GRID = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# What only a second view of the storage (--peer) can measure, and what each check asks.
CROSS_CLIENT_CHECKS = {
    "peer_sees_new_objects": "how long until another client reads a just-closed object",
    "peer_lists_new_objects": "how long until another client lists a new object",
    "new_objects_from_peer": "how long until this client sees another client's new object",
    "exclusive_create_across_clients": "whether a name one client created is refused to another",
    "fsync_reaches_server": "whether fsync puts the bytes where other clients read them",
    "rename_whole_across_clients": "whether another client only ever sees a renamed file whole",
}
# The waits assumed where cross-client visibility is unmeasured on a filesystem without hard
# links (an object-storage FUSE mount): long enough for the mounts in docs/storage.md with
# their documented settings (another client sees a new object within ~1 s; an rclone mount
# with --vfs-cache-mode writes uploads ~5 s after close), with a margin.
UNMEASURED_SETTLE_SECONDS = 10.0
UNMEASURED_READ_SETTLE_SECONDS = 60.0


@dataclass(frozen=True)
class Check:
    """The outcome of one semantics check.

    ``supported`` is True/False, or None when the check could not run (e.g. a prerequisite
    failed). ``seconds`` carries a measured delay where the check has one.
    """

    name: str
    supported: bool | None
    detail: str
    seconds: float | None = None


def errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}"


def _write_file(path: Path, data: bytes = _PAYLOAD) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def check_exclusive_create(work: Path) -> Check:
    path = work / "exclusive"
    try:
        _write_file(path)
    except OSError as exc:
        return Check("exclusive_create", False, f"O_CREAT|O_EXCL create failed: {errno_text(exc)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if _read_file(path) != _PAYLOAD:
            return Check(
                "exclusive_create", False, "second create refused but the first file changed"
            )
        return Check("exclusive_create", True, "a second O_EXCL create is refused with EEXIST")
    except OSError as exc:
        return Check("exclusive_create", False, f"second create failed oddly: {errno_text(exc)}")
    os.close(fd)
    return Check("exclusive_create", False, "a second O_EXCL create of an existing file succeeded")


def check_rename(work: Path) -> Check:
    old, new = work / "rename-a", work / "rename-b"
    try:
        _write_file(old)
        os.rename(old, new)
    except OSError as exc:
        return Check("rename", False, f"rename failed: {errno_text(exc)}")
    if old.exists() or _read_file(new) != _PAYLOAD:
        return Check("rename", False, "after rename the old name remains or the content changed")
    return Check("rename", True, "rename moves a file (not used for publication: it can overwrite)")


def check_hard_links(work: Path) -> Check:
    src, dst = work / "link-src", work / "link-dst"
    try:
        _write_file(src)
        os.link(src, dst)
    except OSError as exc:
        return Check("hard_links", False, f"link failed: {errno_text(exc)}")
    if os.stat(src).st_nlink != 2 or _read_file(dst) != _PAYLOAD:
        return Check("hard_links", False, "link created but link count or content is wrong")
    # Publication relies on link() never replacing an existing name.
    other = work / "link-other"
    _write_file(other, b"other")
    try:
        os.link(other, dst)
    except FileExistsError:
        pass
    except OSError as exc:
        return Check(
            "hard_links", False, f"link onto an existing name failed oddly: {errno_text(exc)}"
        )
    else:
        return Check("hard_links", False, "link onto an existing name replaced it")
    if _read_file(dst) != _PAYLOAD:
        return Check("hard_links", False, "a refused link still changed the existing file")
    return Check("hard_links", True, "link works and never replaces an existing name")


def check_symlinks(work: Path) -> Check:
    target, link = work / "symlink-target", work / "symlink"
    try:
        _write_file(target)
        os.symlink(target.name, link)
        resolved = os.readlink(link)
    except OSError as exc:
        return Check("symlinks", False, f"symlink failed: {errno_text(exc)}")
    if resolved != target.name or _read_file(link) != _PAYLOAD:
        return Check("symlinks", False, "symlink created but does not resolve to its target")
    return Check("symlinks", True, "relative symlinks work (a `latest` link can be kept)")


def check_fsync(work: Path) -> Check:
    path = work / "fsync"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, _PAYLOAD)
        os.fsync(fd)
    except OSError as exc:
        return Check("fsync", False, f"fsync of a file failed: {errno_text(exc)}")
    finally:
        os.close(fd)
    try:
        dfd = os.open(work, os.O_RDONLY)
    except OSError as exc:
        return Check(
            "fsync", True, f"file fsync works; directory cannot be opened: {errno_text(exc)}"
        )
    try:
        os.fsync(dfd)
    except OSError as exc:
        return Check("fsync", True, f"file fsync works; directory fsync fails: {errno_text(exc)}")
    finally:
        os.close(dfd)
    return Check("fsync", True, "file and directory fsync work")


def check_in_place_writes(work: Path) -> Check:
    path = work / "in-place"
    try:
        _write_file(path)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.lseek(fd, 100, os.SEEK_SET)
            write_all(fd, b"XXXX")
        finally:
            os.close(fd)
    except OSError as exc:
        return Check(
            "in_place_writes", False, f"rewriting bytes of a closed file failed: {errno_text(exc)}"
        )
    expected = _PAYLOAD[:100] + b"XXXX" + _PAYLOAD[104:]
    if _read_file(path) != expected:
        return Check("in_place_writes", False, "rewrite accepted but the file does not show it")
    return Check("in_place_writes", True, "closed files can be modified (stores never do this)")


def check_unclosed_visibility(work: Path) -> Check:
    path = work / "unclosed"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        return Check("unclosed_visibility", None, f"cannot create a file: {errno_text(exc)}")
    try:
        write_all(fd, _PAYLOAD)
        listed = path.name in os.listdir(work)
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None
    finally:
        os.close(fd)
    if not listed and size is None:
        return Check("unclosed_visibility", False, "a file being written is invisible until closed")
    if size == len(_PAYLOAD):
        detail = (
            "a file being written is visible with its written size (readers can see partial data)"
        )
    else:
        detail = f"a file being written is visible with size {size} of {len(_PAYLOAD)} written"
    return Check("unclosed_visibility", True, detail)


def check_read_back(
    work: Path,
    timeout: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
    rounds: int = 1,
) -> Check:
    """How long after close() a fresh open reads the full content, and what a read costs.

    The delay runs from close() to the *start* of the first read that returned the whole
    content, so a mount that shows an object at once but answers every read in 30 ms has no
    delay; the reads' own duration is reported apart (median). ``rounds`` files are timed and the
    largest delay counts. Settling errnos, ENOENT and short content met on the way are noted.
    """
    delays: list[float] = []
    latencies: list[float] = []
    seen: set[str] = set()
    for round_ in range(rounds):
        path = work / f"read-back-{round_}"
        data = os.urandom(1 << 16)
        try:
            _write_file(path, data)
        except OSError as exc:
            return Check("read_back", None, f"cannot write a file: {errno_text(exc)}")
        closed = clock()
        while True:
            started = clock()
            try:
                if _read_file(path) == data:
                    latencies.append(clock() - started)
                    delays.append(started - closed)
                    break
                seen.add("short or stale content")
            except OSError as exc:
                if exc.errno not in SETTLING_ERRNOS and not isinstance(exc, FileNotFoundError):
                    return Check("read_back", False, f"reading back failed: {errno_text(exc)}")
                seen.add(errno.errorcode.get(exc.errno or 0, "ENOENT"))
            if clock() - closed > timeout:
                return Check(
                    "read_back",
                    False,
                    f"content still not readable after {timeout:.0f} s ({', '.join(sorted(seen))})",
                    None,
                )
            time.sleep(0.05)
        for _ in range(2):  # the object is visible now: these time the read alone
            started = clock()
            _read_file(path)
            latencies.append(clock() - started)
    delay = max(delays)
    latency = f"a read takes {statistics.median(latencies) * 1e3:.1f} ms (median)"
    if delay <= _AT_ONCE:
        detail = f"readable at once after close in {rounds} of {rounds} rounds; {latency}"
    else:
        detail = (
            f"content readable {delay:.3f} s after close (max of {rounds}, median "
            f"{statistics.median(delays):.3f} s); {latency}"
        )
    extra = f" (after {', '.join(sorted(seen))})" if seen else ""
    return Check("read_back", not seen, detail + extra, delay)


def check_publish_lock(work: Path) -> Check:
    """Does flock() on a directory exclude a second descriptor (on this host)?

    LocalStore's exclusive publication checks that a key is free and renames into it while
    holding this lock, so two writers on one client cannot both take the name.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return Check("publish_lock", False, "no fcntl module on this platform")
    first = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    second = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            return Check("publish_lock", False, f"flock on a directory fails: {errno_text(exc)}")
        try:
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Check("publish_lock", True, "flock on a directory excludes other writers here")
        except OSError as exc:
            return Check("publish_lock", False, f"a second flock fails oddly: {errno_text(exc)}")
        return Check("publish_lock", False, "a second flock on the same directory succeeded")
    finally:
        os.close(second)
        os.close(first)


ALL_CHECKS: tuple[Callable[[Path], Check], ...] = (
    check_exclusive_create,
    check_rename,
    check_hard_links,
    check_symlinks,
    check_fsync,
    check_in_place_writes,
    check_unclosed_visibility,
    check_read_back,
    check_publish_lock,
)


def run_checks(scratch: Path, read_back_timeout: float = 10.0, rounds: int = 1) -> list[Check]:
    """Run every check, each in its own subdirectory of ``scratch``."""
    results = []
    for check in ALL_CHECKS:
        work = scratch / check.__name__.removeprefix("check_")
        work.mkdir()
        if check is check_read_back:
            results.append(check_read_back(work, read_back_timeout, rounds=rounds))
        else:
            results.append(check(work))
    return results


def wait_on_grid(seconds: float) -> float:
    """The smallest value of the probe's wait grid that is at least ``seconds``."""
    for value in _WAIT_GRID:
        if seconds <= value:
            return value
    return math.ceil(seconds / 300.0) * 300.0


def recommend_settings(checks: list[Check]) -> dict[str, object]:
    """LocalStore keyword arguments that are safe given ``checks`` (local and ``--peer`` ones).

    * ``publish``: ``link`` where no-replace hard links work, else ``exclusive`` (a hidden temp
      file renamed into place) where ``O_EXCL`` and rename work. ValueError when neither: no
      LocalStore setting makes objects appear whole there.
    * ``verify_readback``: where fsync fails, where reading back met errors or stale content,
      where the ``publish_lock`` does not exclude, or where a peer showed that create-only does
      not hold between clients: then reading the object back once another client could have
      replaced it is how a collision is caught.
    * ``settle_seconds``: the longest delay measured before an object is seen (here after close,
      by the peer, or here for the peer's objects), with a 1.25x margin, rounded up to a grid.
    * ``read_settle_seconds``: 300 where settling errnos were met; else three times the longest
      cross-client delay, on the grid: how long a missing object a manifest names is waited for.

    A cross-client check reported unmeasured (``supported`` None: no ``--peer``, or it could not
    run) is assumed the worst where it matters, in ``exclusive`` mode (no hard links: an
    object-storage mount, where two clients can both create a name): ``verify_readback``, and at
    least ``UNMEASURED_SETTLE_SECONDS`` / ``UNMEASURED_READ_SETTLE_SECONDS``. A ``link`` mode
    publish is create-only at the server (``link`` never replaces, whichever client asks).
    """
    by_name = {check.name: check for check in checks}

    def works(name: str) -> bool | None:
        check = by_name.get(name)
        return None if check is None else check.supported

    if works("hard_links"):
        publish = "link"
    elif works("exclusive_create") and works("rename") is not False:
        publish = "exclusive"
    elif works("exclusive_create"):
        raise ValueError(
            "this filesystem has neither no-replace hard links nor rename: no LocalStore publish "
            "mode makes an object appear whole on it"
        )
    else:
        raise ValueError(
            "this filesystem supports neither no-replace hard links nor O_EXCL create; "
            "no LocalStore publish mode is safe on it"
        )
    fsync = bool(works("fsync"))
    read_back = by_name.get("read_back")
    settling = read_back is not None and read_back.supported is False
    local_delay = read_back.seconds if read_back is not None and read_back.seconds else 0.0
    peer_delays = [
        by_name[name].seconds or 0.0
        for name in ("peer_sees_new_objects", "new_objects_from_peer")
        if name in by_name
    ]
    collisions = works("exclusive_create_across_clients") is False or (
        publish == "exclusive" and works("publish_lock") is False
    )
    # Without fsync, after stale reads, or where two clients can both take a name, the only
    # proof that an object holds what was written is reading it back.
    unmeasured = publish == "exclusive" and any(
        by_name[name].supported is None for name in CROSS_CLIENT_CHECKS if name in by_name
    )
    verify_readback = not fsync or settling or collisions or unmeasured
    delay = max([local_delay, *peer_delays])
    settle_seconds = wait_on_grid(1.25 * delay) if delay > _AT_ONCE else 0.0
    # Errnos while reading back mean readers on other nodes will see them too: retry reads for
    # minutes, as the spec describes for object-storage mounts. A reader on another client waits
    # for an object its manifest names as long as that client may take to see it.
    cross = max(peer_delays, default=0.0)
    if settling:
        read_settle_seconds = 300.0
    else:
        read_settle_seconds = wait_on_grid(3 * cross) if cross > _AT_ONCE else 0.0
    if unmeasured:
        settle_seconds = max(settle_seconds, UNMEASURED_SETTLE_SECONDS)
        read_settle_seconds = max(read_settle_seconds, UNMEASURED_READ_SETTLE_SECONDS)
    return {
        "publish": publish,
        "fsync": fsync,
        "verify_readback": verify_readback,
        "settle_seconds": settle_seconds,
        "read_settle_seconds": read_settle_seconds,
    }

"""Filesystem-semantics checks for the storage probe, done with plain ``os`` calls.

Each check runs in its own scratch subdirectory and returns a :class:`Check`. A check never
raises for what it is testing: an ``OSError`` from the operation under test means "not
supported" and is recorded with its errno name. From the checks, :func:`recommend_settings`
derives the LocalStore settings that are safe on this filesystem.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from koochak.storage.store import SETTLING_ERRNOS

_PAYLOAD = b"koochak-probe\n" * 293  # 4102 bytes: not a block multiple, so sizes are exact


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


def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}"


def _write_file(path: Path, data: bytes = _PAYLOAD) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
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
        return Check("exclusive_create", False, f"O_CREAT|O_EXCL create failed: {_errno_text(exc)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        if _read_file(path) != _PAYLOAD:
            return Check(
                "exclusive_create", False, "second create refused but the first file changed"
            )
        return Check("exclusive_create", True, "a second O_EXCL create is refused with EEXIST")
    except OSError as exc:
        return Check("exclusive_create", False, f"second create failed oddly: {_errno_text(exc)}")
    os.close(fd)
    return Check("exclusive_create", False, "a second O_EXCL create of an existing file succeeded")


def check_rename(work: Path) -> Check:
    old, new = work / "rename-a", work / "rename-b"
    try:
        _write_file(old)
        os.rename(old, new)
    except OSError as exc:
        return Check("rename", False, f"rename failed: {_errno_text(exc)}")
    if old.exists() or _read_file(new) != _PAYLOAD:
        return Check("rename", False, "after rename the old name remains or the content changed")
    return Check("rename", True, "rename moves a file (not used for publication: it can overwrite)")


def check_hard_links(work: Path) -> Check:
    src, dst = work / "link-src", work / "link-dst"
    try:
        _write_file(src)
        os.link(src, dst)
    except OSError as exc:
        return Check("hard_links", False, f"link failed: {_errno_text(exc)}")
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
            "hard_links", False, f"link onto an existing name failed oddly: {_errno_text(exc)}"
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
        return Check("symlinks", False, f"symlink failed: {_errno_text(exc)}")
    if resolved != target.name or _read_file(link) != _PAYLOAD:
        return Check("symlinks", False, "symlink created but does not resolve to its target")
    return Check("symlinks", True, "relative symlinks work (a `latest` link can be kept)")


def check_fsync(work: Path) -> Check:
    path = work / "fsync"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, _PAYLOAD)
        os.fsync(fd)
    except OSError as exc:
        return Check("fsync", False, f"fsync of a file failed: {_errno_text(exc)}")
    finally:
        os.close(fd)
    try:
        dfd = os.open(work, os.O_RDONLY)
    except OSError as exc:
        return Check(
            "fsync", True, f"file fsync works; directory cannot be opened: {_errno_text(exc)}"
        )
    try:
        os.fsync(dfd)
    except OSError as exc:
        return Check("fsync", True, f"file fsync works; directory fsync fails: {_errno_text(exc)}")
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
            _write_all(fd, b"XXXX")
        finally:
            os.close(fd)
    except OSError as exc:
        return Check(
            "in_place_writes", False, f"rewriting bytes of a closed file failed: {_errno_text(exc)}"
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
        return Check("unclosed_visibility", None, f"cannot create a file: {_errno_text(exc)}")
    try:
        _write_all(fd, _PAYLOAD)
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
    work: Path, timeout: float = 10.0, clock: Callable[[], float] = time.monotonic
) -> Check:
    """Time from close() until a fresh open reads the full content; note settling errnos seen."""
    path = work / "read-back"
    data = os.urandom(1 << 16)
    try:
        _write_file(path, data)
    except OSError as exc:
        return Check("read_back", None, f"cannot write a file: {_errno_text(exc)}")
    start = clock()
    seen: set[str] = set()
    while True:
        try:
            if _read_file(path) == data:
                delay = clock() - start
                extra = f" (after {', '.join(sorted(seen))})" if seen else ""
                return Check(
                    "read_back", not seen, f"content readable after {delay:.3f} s{extra}", delay
                )
            seen.add("short or stale content")
        except OSError as exc:
            if exc.errno not in SETTLING_ERRNOS and not isinstance(exc, FileNotFoundError):
                return Check("read_back", False, f"reading back failed: {_errno_text(exc)}")
            seen.add(errno.errorcode.get(exc.errno or 0, "ENOENT"))
        if clock() - start > timeout:
            return Check(
                "read_back",
                False,
                f"content still not readable after {timeout:.0f} s ({', '.join(sorted(seen))})",
                None,
            )
        time.sleep(0.05)


ALL_CHECKS: tuple[Callable[[Path], Check], ...] = (
    check_exclusive_create,
    check_rename,
    check_hard_links,
    check_symlinks,
    check_fsync,
    check_in_place_writes,
    check_unclosed_visibility,
    check_read_back,
)


def run_checks(scratch: Path, read_back_timeout: float = 10.0) -> list[Check]:
    """Run every check, each in its own subdirectory of ``scratch``."""
    results = []
    for check in ALL_CHECKS:
        work = scratch / check.__name__.removeprefix("check_")
        work.mkdir()
        if check is check_read_back:
            results.append(check_read_back(work, read_back_timeout))
        else:
            results.append(check(work))
    return results


def recommend_settings(checks: list[Check]) -> dict[str, object]:
    """LocalStore keyword arguments that are safe given ``checks``.

    Raises ValueError when the filesystem can publish create-only neither by hard link nor by
    O_EXCL: no LocalStore setting is safe there.
    """
    by_name = {check.name: check for check in checks}
    links = by_name.get("hard_links")
    exclusive = by_name.get("exclusive_create")
    if links is not None and links.supported:
        publish = "link"
    elif exclusive is not None and exclusive.supported:
        publish = "exclusive"
    else:
        raise ValueError(
            "this filesystem supports neither no-replace hard links nor O_EXCL create; "
            "no LocalStore publish mode is safe on it"
        )
    fsync = bool(by_name.get("fsync") and by_name["fsync"].supported)
    read_back = by_name.get("read_back")
    delay = read_back.seconds if read_back is not None else None
    settling = read_back is not None and not read_back.supported
    # Without fsync, or when a closed file is not immediately readable, the only proof that the
    # bytes landed is reading them back.
    verify_readback = not fsync or settling or (delay is not None and delay > 0.01)
    settle_seconds = 0.0 if delay is None or delay <= 0.01 else round(max(delay * 2, 0.1), 2)
    # Errnos while reading back mean readers on other nodes will see them too: retry reads for
    # minutes, as the spec describes for object-storage mounts.
    read_settle_seconds = 300.0 if settling else 0.0
    return {
        "publish": publish,
        "fsync": fsync,
        "verify_readback": verify_readback,
        "settle_seconds": settle_seconds,
        "read_settle_seconds": read_settle_seconds,
    }

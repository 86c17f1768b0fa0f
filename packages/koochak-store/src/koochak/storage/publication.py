"""Numbered publication in a Store: an object counts only once its ready manifest exists.

``publish`` puts the object create-only (durable when put returns), then commits it with
``<name>.ready.json``; ``unpublish`` and pruning remove the manifest first, so a reader never
trusts an object that is going away. ``read_verified`` checks one publication against its
manifest; ``highest_valid`` finds the newest one that validates, skipping invalid candidates and
raising every other error. Used by checkpoints; works on every Store.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from koochak.storage import _publish_intent
from koochak.storage._publish_intent import INTENT_SUFFIX
from koochak.storage.fsutil import fsync_dir
from koochak.storage.keys import TEMP_PREFIX, validate_key
from koochak.storage.named import get_named
from koochak.storage.ready_manifest import (
    MANIFEST_VERSION,
    READY_SUFFIX,
    InvalidArtifact,
    _manifest_bytes,
    _parse_manifest,
)
from koochak.storage.store import Store, capabilities_of, exists, list_shallow, open_store

__all__ = [
    "Publication",
    "publish",
    "claimed",
    "unpublish",
    "read_manifest",
    "read_verified",
    "published_candidates",
    "highest_valid",
    "numbered_pattern",
    "prune_keep_last_k",
]

# Named for koochak.storage.artifact, where publication lived before it had its own module.
_log = logging.getLogger("koochak.storage.artifact")
_T = TypeVar("_T")
_CHUNK = 8 << 20
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Publication:
    """A committed object and its ready manifest."""

    artifact_id: str  # f"{kind}/{name}", e.g. "checkpoint/step000000100.pt"
    key: str  # object key in the store
    size: int
    sha256: str
    manifest_key: str  # key + READY_SUFFIX
    path: str | None  # absolute local path when the store has one


def _check_name(name: str) -> str:
    validate_key(name)
    for suffix, marks in ((READY_SUFFIX, "manifests"), (INTENT_SUFFIX, "intent records")):
        if name.endswith(suffix):
            raise ValueError(f"artifact name {name!r} ends in {suffix!r}, which marks {marks}")
    return name


def publish(
    store: Store,
    name: str,
    data: bytes | bytearray | memoryview | BinaryIO | Iterable[bytes],
    *,
    kind: str = "checkpoint",
    keep_last_k: int | None = None,
    pattern: str | None = None,
    latest: str | bool | None = True,
    provenance: dict[str, Any] | None = None,
    intent: _publish_intent.Intent | None = None,
) -> Publication:
    """Publish ``data`` as ``name`` and commit it with ``name + READY_SUFFIX``.

    The object is put create-only and is durable before its manifest is written, so a reader
    that finds the manifest finds the whole object. Before the object, ``publish`` puts an intent
    record ``name + ".publishing.json"`` (who is publishing, and by when it commits or gives
    up) and it deletes it after the manifest. A publisher never deletes an object it did not
    create: the intent goes first, and while another publisher's intent stands (one not proven
    dead: same host, that process is gone; any host, its deadline passed) publish raises
    FileExistsError naming it and touches nothing. Holding the intent, a committed ``name``
    (object and manifest) is a finished publication and is replaced (manifest first), and an
    object without its manifest is a dead publisher's (or a plain put's) leftover, replaced. Losing a race for the name to another publisher is a
    FileExistsError too, and removes nothing of theirs. ``keep_last_k`` prunes older
    publications whose keys fully match ``pattern`` (group 1 = the number), manifest before
    object; without ``pattern`` it is derived from a numbered ``name`` (``numbered_pattern``:
    ``step000000100.pt`` -> ``step(\\d+)\\.pt``). ``latest`` names a symlink to the new
    object; the default (True) is ``latest<suffix>`` beside a numbered name (``latest.pt``),
    False or None keeps none. It is kept only on stores that declare ``publish="link"`` and a
    ``root`` (``LocalStore(publish="link")``): write-once stores cannot replace it atomically,
    so they never get one.

    ``intent`` is the caller's own claim on ``name`` (``claimed``), for a publication that
    writes more objects than the one under ``name`` (a checkpoint's parts) and must hold the
    name before it writes any of them: publish then neither claims nor drops the intent.
    """
    _check_name(name)
    if not isinstance(kind, str) or not _KIND.fullmatch(kind):
        raise ValueError(f"publish: kind={kind!r}; expected a word such as 'checkpoint'")
    regex = None
    if keep_last_k is not None:
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or keep_last_k < 1:
            raise ValueError(f"publish: keep_last_k={keep_last_k!r}; expected an int >= 1 or None")
        if pattern is None:
            pattern = numbered_pattern(name)
        regex = _compile(pattern)
        if regex.fullmatch(name) is None:
            raise ValueError(f"publish: name {name!r} does not fully match pattern {pattern!r}")
    derived_latest = latest is True
    latest = _latest_name(name, latest)
    if provenance is not None and not isinstance(provenance, dict):
        raise ValueError(
            f"publish: provenance must be a dict or None, got {type(provenance).__name__}"
        )
    manifest_key = name + READY_SUFFIX

    # The intent first: while it stands no other publisher (one that honours intents) touches
    # the name, so what is found under it below is a finished publication or a dead one's.
    held = intent is not None
    if intent is not None and intent.key != name:
        raise ValueError(f"publish({name!r}): the intent given claims {intent.key!r}")
    intent = intent if intent is not None else _claim(store, name)
    try:
        if exists(store, manifest_key):
            unpublish(store, name)  # a finished publication: replaced, manifest first
        elif exists(store, name):
            # Uncommitted, and no live publisher holds the name: the leftover of one that died
            # (its intent proved it, in _claim) or of a plain put.
            _log.warning("replacing %s/%s: an object without its ready manifest, whose publisher "
                         "is gone", store.location, name)  # fmt: skip
            store.delete(name)
        info = store.put(name, data)
    except BaseException:
        _drop(store, intent, held)
        raise
    sha256 = info.sha256 if info.sha256 is not None else _sha_of_object(store, name)
    doc = {
        "version": MANIFEST_VERSION,
        "artifact_id": f"{kind}/{name}",
        "key": name,
        "type": "file",
        "size": info.size,
        "sha256": sha256,
        "file_count": 1,
        "provenance": provenance,
    }
    try:
        if time.time() > intent.deadline:
            # Past its deadline another publisher may already have proven this one dead and
            # taken the name: committing now could pair this manifest with its object.
            raise TimeoutError(
                f"publish({name!r}): the object took past the intent's deadline "
                f"({_publish_intent.LEASE_SECONDS:.0f} s); not committed"
            )
        store.put(manifest_key, _manifest_bytes(doc))
    except FileExistsError:
        # Another publisher committed the name: the object may be theirs now. Leave both.
        _drop(store, intent, held)
        raise
    except BaseException:
        # Without its manifest the object is invisible to readers; remove it (this put made it)
        # so a failed publish leaves no stray bytes, then report the original error.
        try:
            store.delete(name)
        except OSError:
            pass
        _drop(store, intent, held)
        raise
    _drop(store, intent, held)
    publication = Publication(
        artifact_id=doc["artifact_id"],
        key=name,
        size=info.size,
        sha256=sha256,
        manifest_key=manifest_key,
        path=store.local_path(name),
    )
    declared = capabilities_of(store)
    if latest is not None and declared.publish == "link" and declared.root is not None:
        try:
            _point_latest(declared.root, latest, name)
        except FileExistsError:
            if not derived_latest:
                raise
            # Only the default pointer: a real file of that name (an older tool's copy) is the
            # user's; the publication stands, and the file is neither replaced nor an error.
            _log.warning("%s/%s is a real file, not a symlink; not pointing it at %s",
                         store.location, latest, name)  # fmt: skip
    if regex is not None:
        _prune(store, regex, pattern, keep_last_k)  # type: ignore[arg-type]
    return publication


# The last run of digits in a key's final segment is its number: step000000100.pt -> 100.
_NUMBERED = re.compile(r"(?P<head>(?:.*/)?[^/]*?)(?P<number>[0-9]+)(?P<tail>[^/0-9]*)")


def numbered_pattern(name: str) -> str:
    """The pattern matching every sibling of a numbered ``name``, group 1 being the number.

    The number is the last run of digits in the final path segment; the text around it is
    kept literally: ``"runs/a/step000000100.pt"`` -> ``r"runs/a/step(\\d+)\\.pt"``. ValueError
    when the final segment has no digits (pass ``pattern=`` for such names).
    """
    match = _NUMBERED.fullmatch(name)
    if match is None:
        raise ValueError(
            f"publish: name {name!r} has no number in its last segment to prune by; pass "
            "pattern=, a regex whose group 1 is the number (e.g. r'model-(\\d+)\\.bin')"
        )
    return re.escape(match["head"]) + r"(\d+)" + re.escape(match["tail"])


def _latest_name(name: str, latest: str | bool | None) -> str | None:
    """The ``latest`` symlink's key for ``publish``: derived (True), none, or given."""
    if latest is None or latest is False:
        return None
    if latest is True:
        match = _NUMBERED.fullmatch(name)
        if match is None:
            return None  # an unnumbered name is already stable; nothing to point at it
        latest = f"{match['head'].rpartition('/')[0]}/latest{match['tail']}".lstrip("/")
        if latest == name:
            return None
        return latest
    if not isinstance(latest, str):
        raise ValueError(f"publish: latest={latest!r}; expected a name, True or False")
    _check_name(latest)
    if latest == name:
        raise ValueError(f"publish: latest={latest!r} is the artifact's own name")
    return latest


def prune_keep_last_k(directory: str | os.PathLike[str] | Store, pattern: str, k: int) -> list[str]:
    """Keep the ``k`` highest-numbered publications under ``directory``; return removed keys.

    ``directory`` is a directory, a ``scheme://`` location or a Store; ``pattern`` is a regex
    whose group 1 is the number and which must match a whole key (``r"step(\\d+)\\.pt"``).
    Only committed pairs (an object with its ready manifest) are counted and removed, each
    manifest before its object, so an object still being published is never touched.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"prune_keep_last_k: k={k!r}; expected an int >= 0")
    store = open_store(directory)
    regex = _compile(pattern)
    return _prune(store, regex, pattern, k)


def _claim(store: Store, name: str) -> _publish_intent.Intent:
    """Put this process's intent to publish ``name``; FileExistsError while another publisher
    (one not provably dead) holds it. A dead publisher's intent is removed first."""
    intent = _publish_intent.ours(name)
    key = name + INTENT_SUFFIX
    try:
        store.put(key, intent.to_bytes())
    except FileExistsError:
        dead = _clear_dead_intent(store, name)  # raises unless its publisher is provably dead
        store.put(key, intent.to_bytes())
        return replace(intent, took_over=dead)
    return intent


@contextmanager
def claimed(store: Store, name: str) -> Iterator[_publish_intent.Intent]:
    """Hold the intent to publish ``name`` for the block (put first, deleted on leaving it).

    FileExistsError naming the publisher, touching nothing, while another publisher's intent
    stands (one not proven dead by the rules of ``koochak.storage._publish_intent``); a dead
    one's is taken over with one line, and the intent yielded says so (``took_over``: who that
    publisher was). Inside the block this process owns the name: what it finds under it is a
    finished publication or a leftover (a dead publisher's: ``took_over`` says so), and
    what it writes there is its own. Pass the intent to ``publish(..., intent=)`` to commit within the block.
    """
    _check_name(name)
    intent = _claim(store, name)
    try:
        yield intent
    finally:
        _drop(store, intent)


def _drop(store: Store, intent: _publish_intent.Intent, held: bool = False) -> None:
    if held:  # the caller's claim (``claimed``): it drops it when its block ends
        return
    try:
        store.delete(intent.key + INTENT_SUFFIX)
    except OSError as exc:
        _log.warning("could not remove the intent record %s%s: %s", intent.key, INTENT_SUFFIX, exc)


def _clear_dead_intent(store: Store, name: str) -> str:
    """Remove the intent record of ``name`` if it proves its publisher dead and return who that
    was ("" when it finished meanwhile); else FileExistsError naming that publisher, removing
    nothing."""
    key = name + INTENT_SUFFIX
    where = f"{store.location}/{key}"
    try:
        intent = _publish_intent.parse(store.get(key), where)
    except FileNotFoundError:
        return ""  # its publisher finished meanwhile: try again
    except ValueError as exc:
        raise FileExistsError(
            errno.EEXIST, f"{name} is being published, and its intent record is unreadable "
            f"({exc}); remove {key} once no publisher of it runs", where,
        ) from None  # fmt: skip
    why = _publish_intent.why_dead(intent)
    if why is None:
        raise FileExistsError(
            errno.EEXIST,
            f"{name} is being published by {intent.describe()}; not replaced",
            f"{store.location}/{name}",
        )
    _log.warning("%s/%s: its publisher, %s, is gone (%s); taking the name over",
                 store.location, name, intent.describe(), why)  # fmt: skip
    try:
        store.delete(key)
    except FileNotFoundError:
        pass
    return intent.describe()


def unpublish(store: Store, name: str) -> None:
    """Un-commit ``name``: delete its manifest, then the object. Missing parts are fine."""
    _check_name(name)
    for key in (name + READY_SUFFIX, name):
        try:
            store.delete(key)
        except FileNotFoundError:
            pass


def read_manifest(store: Store, name: str) -> tuple[Publication, bytes]:
    """The publication ``name`` as its ready manifest describes it, and the manifest's bytes.

    Only the manifest is read, not the object: this says what was committed, not that the
    object is still intact (``read_verified`` checks that). Raises InvalidArtifact when the
    manifest is missing, malformed, of an unknown version or describes another key; any other
    OSError propagates. The bytes let a caller copy the manifest unchanged (a replica commits
    with the very document its source committed with).
    """
    _check_name(name)
    manifest_key = name + READY_SUFFIX
    where = f"{store.location}/{manifest_key}"
    try:
        raw = store.get(manifest_key)
    except FileNotFoundError:
        raise InvalidArtifact(f"{where}: no ready manifest; {name!r} is not committed") from None
    doc = _parse_manifest(raw, where)
    if doc["key"] != name or doc["type"] != "file":
        raise InvalidArtifact(
            f"{where}: manifest describes {doc['key']!r} ({doc['type']}), not {name!r}"
        )
    publication = Publication(
        artifact_id=doc["artifact_id"],
        key=name,
        size=doc["size"],
        sha256=doc["sha256"],
        manifest_key=manifest_key,
        path=store.local_path(name),
    )
    return publication, raw


def read_verified(store: Store, name: str) -> tuple[Publication, bytes]:
    """Read ``name`` once and check it against its ready manifest.

    Raises InvalidArtifact when the manifest is missing, malformed or of an unknown version, or
    when the object's size or SHA256 differ. An object the manifest names but this client does
    not see is waited for (the store's ``read_settle_seconds``, ``koochak.storage.named``) and
    then raises FileNotFoundError, never InvalidArtifact: a late object is not an invalid one.
    Any other OSError propagates: an unreadable object is not evidence that it is invalid.
    """
    committed, _ = read_manifest(store, name)
    manifest_key = committed.manifest_key
    where = f"{store.location}/{manifest_key}"
    try:
        # Missing here may only mean not visible yet on this client: wait read_settle_seconds.
        data = get_named(store, name, named_by=manifest_key)
    except FileNotFoundError:
        if not exists(store, manifest_key):  # unpublished meanwhile (pruned): skip it
            raise InvalidArtifact(f"{where}: unpublished while it was read") from None
        raise  # named by a manifest that is still there: never "absent"
    if len(data) != committed.size:
        raise InvalidArtifact(
            f"{store.location}/{name}: {len(data)} bytes, manifest says {committed.size}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != committed.sha256:
        raise InvalidArtifact(
            f"{store.location}/{name}: SHA256 {digest}, manifest says {committed.sha256}"
        )
    return committed, data


def published_candidates(
    store: Store, pattern: str, *, leave_out: str | None = None
) -> list[tuple[int, str]]:
    """``(number, key)`` for every key fully matching ``pattern`` that has a manifest, highest
    first. ``leave_out``: keys with this string after the pattern's literal prefix are not
    listed at all (``list_shallow``; e.g. ``".part-"``: a tier's checkpoints, not their parts),
    so the listing grows with the artifacts, not with the objects beside them."""
    return _candidates(store, _compile(pattern), pattern, leave_out)


def highest_valid(
    store: Store,
    pattern: str,
    *,
    check: Callable[[Publication, bytes], _T] | None = None,
) -> tuple[Publication, _T | bytes] | None:
    """The highest-numbered publication that validates, or None when there is none.

    Candidates are tried in descending order; one whose manifest, size or SHA256 is wrong (or
    for which ``check`` raises InvalidArtifact) is logged and skipped. Every other error is
    raised, so an unreadable newest artifact never silently rolls back to an older one.
    """
    for number, key in published_candidates(store, pattern):
        try:
            publication, data = read_verified(store, key)
            if check is None:
                return publication, data
            return publication, check(publication, data)
        except InvalidArtifact as exc:
            _log.warning("skipping %s #%d (%s): %s", key, number, store.location, exc)
    return None


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a regular expression: {exc}") from None
    if regex.groups < 1:
        raise ValueError(
            f"pattern {pattern!r} needs a group capturing the number, e.g. r'step(\\d+)\\.pt'"
        )
    return regex


def _literal_prefix(pattern: str) -> str:
    """Plain text every match of ``pattern`` starts with, so listing can be narrowed to it.

    Conservative: stops at the first metacharacter, drops a character a quantifier makes
    optional, and gives up on alternation (a prefix that is too short only costs listing time).
    """
    body = pattern[1:] if pattern.startswith("^") else pattern
    if "|" in body:
        return ""
    prefix = []
    for index, char in enumerate(body):
        if char in ".^$*+?{}[]\\|()":
            break
        following = body[index + 1 : index + 2]
        if following in ("?", "*", "{"):
            break
        prefix.append(char)
        if following == "+":
            break
    return "".join(prefix)


def _candidates(
    store: Store, regex: re.Pattern[str], pattern: str, leave_out: str | None = None
) -> list[tuple[int, str]]:
    # A manifest makes a candidate, whether or not this client lists its object yet: through a
    # mount the object may show later (read_verified waits for it), and skipping it would roll
    # resume back to an older checkpoint. An object without its manifest is not committed.
    prefix = _literal_prefix(pattern)
    infos = store.list(prefix) if leave_out is None else list_shallow(store, prefix, leave_out)
    listed = {info.key for info in infos}
    found = []
    for manifest in listed:
        if not manifest.endswith(READY_SUFFIX):
            continue
        key = manifest[: -len(READY_SUFFIX)]
        match = regex.fullmatch(key)
        if match is None:
            continue
        try:
            number = int(match.group(1))
        except (TypeError, ValueError):
            raise ValueError(
                f"pattern {pattern!r}: group 1 matched {match.group(1)!r} in {key!r}, not a number"
            ) from None
        found.append((number, key))
    found.sort(reverse=True)
    return found


def _prune(store: Store, regex: re.Pattern[str], pattern: str, keep: int) -> list[str]:
    removed = []
    for _, key in _candidates(store, regex, pattern)[keep:]:
        unpublish(store, key)
        removed.append(key)
    return removed


def _sha_of_object(store: Store, key: str) -> str:
    """For third-party stores whose put() does not report a digest: hash what was stored."""
    sha = hashlib.sha256()
    with store.open(key) as stream:
        while block := stream.read(_CHUNK):
            sha.update(block)
    return sha.hexdigest()


def _point_latest(root: str, latest: str, name: str) -> None:
    """Swing the ``latest`` symlink to ``name`` atomically (symlink under a temp name, rename).

    The pointer is a convenience for people: a filesystem that refuses a directory fsync (a
    link-mode store configured with ``fsync: false``) keeps it without one."""
    link_path = Path(root) / latest
    target = os.path.relpath(Path(root) / name, link_path.parent)
    link_path.parent.mkdir(parents=True, exist_ok=True)
    if link_path.exists() and not link_path.is_symlink():
        raise FileExistsError(
            errno.EEXIST, "latest= names a real object, not a symlink", str(link_path)
        )
    temp = link_path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}-{link_path.name[:120]}"
    os.symlink(target, temp)
    try:
        os.replace(temp, link_path)  # the alias is the one thing meant to change
    except BaseException:
        os.unlink(temp)
        raise
    try:
        fsync_dir(link_path.parent)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
            raise

"""The root directory: paths, create-only writes, conflicts, the journal (contract sections 2, 6)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


class StorageError(RuntimeError):
    """Base of the root's storage errors."""


class ConflictError(StorageError):
    """An idempotency key reused with different content."""


class RequestConflict(ConflictError):
    """submit_job / submit_workflow: the request id names a different request."""


class ReportConflict(ConflictError):
    """publish_event: the event id names a different report (or a rejected one)."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def digest(doc: Any) -> str:
    return hashlib.sha256(
        json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    ).hexdigest()


def scoped_hash(project_id: str, key: str) -> str:
    text = key if project_id == "default" else f"{project_id}\0{key}"
    return sha256_text(text)[:20]


def queue_id(root: Path) -> str:
    return "queue-" + sha256_text(str(root))[:16]


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_atomic(path: Path, doc: Any, *, mode: int | None = None) -> None:
    """Replace ``path`` by a complete file (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, path)


def create_only(path: Path, data: bytes) -> bool:
    """Publish ``data`` at ``path`` unless something is there already (hard link); True if new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def create_dir_only(path: Path, filename: str, doc: Any) -> bool:
    """Publish ``path/filename`` by renaming a complete temp directory; True if new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".tmp-"))
    write_atomic(tmp / filename, doc)
    try:
        os.rename(tmp, path)
    except OSError:
        (tmp / filename).unlink()
        tmp.rmdir()
        if path.exists():
            return False
        raise
    return True


def report_path(root: Path, job_id: str, event_id: str) -> Path:
    return root / "reports" / job_id / f"{sha256_text(event_id)}.json"


def receipt_path(root: Path, job_id: str, event_id: str) -> Path:
    return root / "reports" / ".accepted" / job_id / f"{sha256_text(event_id)}.json"


def read_state(root: Path) -> dict[str, Any] | None:
    try:
        return read_json(root / "state.json")
    except FileNotFoundError:
        return None


def read_journal(root: Path, offset: int, end: int, limit: int) -> tuple[list[dict], int, bool]:
    """Committed journal records from byte ``offset`` to ``end``: (records, new offset, more)."""
    records: list[dict] = []
    path = root / "journal.jsonl"
    if end <= offset or not path.exists():
        return records, offset, False
    with open(path, "rb") as f:
        f.seek(offset)
        while offset < end and len(records) < limit:
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            offset += len(line)
            records.append(json.loads(line))
    return records, offset, offset < end

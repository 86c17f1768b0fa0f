"""The manifest and file-table reader treats its input as untrusted: clean ValueErrors only."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from koochak.data.collection import (
    FileEntry,
    FilesTable,
    Manifest,
    PackInfo,
    check_relative_path,
    encode_files_table,
    encode_manifest,
    load_collection,
    matches_any,
    parse_files_table,
    parse_manifest,
)
from koochak.storage.store import LocalStore

SHA = "ab" * 32


def _entries() -> list[FileEntry]:
    return [
        FileEntry("a/one.txt", 10, SHA, 0o644, 1_700_000_000_123_456_789, "a", "packs/pack-000000.tar", 512),
        FileEntry("a/two.txt", 600, SHA, 0o600, 5, "a", "packs/pack-000000.tar", 1536),
        FileEntry("big.bin", 10_000, SHA, 0o755, -3, ".", object="objects/big.bin"),
    ]


def _manifest(entries: list[FileEntry], table: bytes, pack_size: int = 4096) -> Manifest:
    return Manifest(
        version=1, kind="koochak.collection", created="2026-01-01T00:00:00+00:00",
        files=len(entries), bytes=sum(e.size for e in entries),
        objects=sum(1 for e in entries if e.object), packs=(PackInfo("packs/pack-000000.tar", pack_size, SHA, 2),),
        files_table=FilesTable("files.jsonl.gz", len(table), hashlib.sha256(table).hexdigest()),
        metadata={"source": "/data/x"},
    )


def _docs() -> tuple[dict, list[dict]]:
    entries = _entries()
    table = encode_files_table(entries)
    manifest = json.loads(encode_manifest(_manifest(entries, table)))
    lines = [json.loads(line) for line in gzip.decompress(table).decode().splitlines()]
    return manifest, lines


def _parse(manifest: dict, lines: list[dict]) -> tuple[FileEntry, ...]:
    """Encode hand-edited docs, fixing up the table digest so the edit itself is what's checked."""
    table = gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode())
    manifest = dict(manifest)
    manifest["files_table"] = {
        "key": "files.jsonl.gz", "size": len(table), "sha256": hashlib.sha256(table).hexdigest()
    }
    return parse_files_table(table, parse_manifest(json.dumps(manifest)))


def test_round_trip_keeps_every_field() -> None:
    entries = _entries()
    table = encode_files_table(entries)
    manifest = parse_manifest(encode_manifest(_manifest(entries, table)))
    assert manifest.metadata == {"source": "/data/x"}
    assert parse_files_table(table, manifest) == tuple(entries)


def test_unusual_but_valid_packed_lines_read_back_exactly() -> None:
    # A backslash (an ordinary character in a POSIX name), non-ASCII names, a negative mtime,
    # the largest mode, an object among packed files: the same entries whichever check ran.
    entries = [
        FileEntry("a/b\\c.txt", 0, SHA, 0o7777, -1, "a", "packs/pack-000000.tar", 512),
        FileEntry("a/été/日本.txt", 600, SHA, 0, 0, "", "packs/pack-000000.tar", 1536),
        FileEntry("big.bin", 10_000, SHA, 0o755, -3, ".", object="objects/big.bin"),
    ]
    table = encode_files_table(entries)
    assert parse_files_table(table, parse_manifest(encode_manifest(_manifest(entries, table)))) == (
        tuple(entries)
    )


def test_files_table_is_deterministic() -> None:
    assert encode_files_table(_entries()) == encode_files_table(_entries())


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda m: m.update(version=2), "version"),
        (lambda m: m.update(version=True), "version"),
        (lambda m: m.update(colour="red"), "colour"),
        (lambda m: m.pop("created"), "created"),
        (lambda m: m.update(kind="other"), "kind"),
        (lambda m: m.update(files=-1), "files"),
        (lambda m: m.update(bytes="12"), "bytes"),
        (lambda m: m["packs"][0].update(key="../pack.tar"), "key"),
        (lambda m: m["packs"][0].update(key="packs/evil.tar"), "key"),
        (lambda m: m["packs"][0].update(size=10), "size"),
        (lambda m: m["packs"][0].update(sha256="XYZ"), "sha256"),
        (lambda m: m["packs"].append(dict(m["packs"][0])), "duplicate"),
        (lambda m: m.update(metadata=[]), "metadata"),
        (lambda m: m["files_table"].update(key="other.gz"), "files_table"),
    ],
)
def test_malformed_manifest_names_the_field(edit, field: str) -> None:
    manifest, _ = _docs()
    edit(manifest)
    with pytest.raises(ValueError, match=field):
        parse_manifest(json.dumps(manifest))


@pytest.mark.parametrize(
    ("index", "edit", "field"),
    [
        (0, lambda e: e.update(path="../escape"), "path"),
        (0, lambda e: e.update(path="/etc/passwd"), "absolute"),
        (0, lambda e: e.update(path="a/./b"), "path"),
        (0, lambda e: e.update(path="a//b"), "path"),
        (0, lambda e: e.update(path=""), "path"),
        (0, lambda e: e.update(path="a\x00b"), "NUL"),
        (1, lambda e: e.update(path="a/one.txt"), "duplicate"),
        (1, lambda e: e.update(path="a/one.txt/inner"), "under the file"),
        (0, lambda e: e.update(size=-1), "size"),
        (0, lambda e: e.update(size=1.5), "size"),
        (0, lambda e: e.update(mode=0o17777), "mode"),
        (0, lambda e: e.update(mtime_ns="now"), "mtime_ns"),
        (0, lambda e: e.update(sha256="00"), "sha256"),
        (0, lambda e: e.update(owner="root"), "owner"),
        (0, lambda e: e.pop("group"), "group"),
        (0, lambda e: e.update(offset=100), "offset"),
        (0, lambda e: e.update(offset=0), "offset"),
        (1, lambda e: e.update(offset=3584), "outside"),
        (1, lambda e: e.update(offset=512), "overlaps"),
        (0, lambda e: e.update(pack="packs/pack-000009.tar"), "pack"),
        (0, lambda e: e.pop("offset"), "offset"),
        (0, lambda e: e.update(object="objects/x"), "object"),
        (2, lambda e: e.update(object="elsewhere/big.bin"), "object"),
        (2, lambda e: e.update(object="objects/../x"), "object"),
        (2, lambda e: e.pop("object"), "pack' or 'object"),
        (2, lambda e: e.update(size=1), "bytes"),
        # The common packed line is checked on a fast path first; each of these fails it and
        # must still be refused, by the full check, naming the field.
        (0, lambda e: e.update(size=True), "size"),
        (0, lambda e: e.update(mode=True), "mode"),
        (0, lambda e: e.update(mode=-1), "mode"),
        (0, lambda e: e.update(mtime_ns=False), "mtime_ns"),
        (0, lambda e: e.update(mtime_ns=1.0), "mtime_ns"),
        (0, lambda e: e.update(group=5), "group"),
        (0, lambda e: e.update(sha256="AB" * 32), "sha256"),
        (0, lambda e: e.update(offset=True), "offset"),
        (0, lambda e: e.update(pack=5), "pack"),
        (0, lambda e: e.update(path=5), "path"),
        (0, lambda e: e.update(path="a/\ud800.txt"), "UTF-8"),
        (0, lambda e: e.update(path="a/.."), "path"),
        (1, lambda e: e.update(path="a/one.txt/x/y"), "under the file"),
    ],
)
def test_malformed_entry_names_the_field(index: int, edit, field: str) -> None:
    manifest, lines = _docs()
    edit(lines[index])
    with pytest.raises(ValueError, match=field):
        _parse(manifest, lines)


def test_counts_must_agree_with_the_manifest() -> None:
    manifest, lines = _docs()
    with pytest.raises(ValueError, match="'files'"):
        _parse(manifest, lines[1:])


def test_tampered_table_is_refused_by_digest() -> None:
    entries = _entries()
    table = encode_files_table(entries)
    manifest = _manifest(entries, table)
    with pytest.raises(ValueError, match="files_table"):
        parse_files_table(table[:-1] + b"\x01", manifest)


def test_load_collection_needs_a_committed_manifest(tmp_path) -> None:
    store = LocalStore(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no collection: manifest.json not found"):
        load_collection(store)
    entries = _entries()
    table = encode_files_table(entries)
    store.put("manifest.json", encode_manifest(_manifest(entries, table)))
    with pytest.raises(ValueError, match="files.jsonl.gz is missing"):
        load_collection(store)
    store.put("files.jsonl.gz", table)
    assert load_collection(str(tmp_path)).entries == tuple(entries)


def test_relative_path_check() -> None:
    assert check_relative_path("a/b c/d.txt", "x") == "a/b c/d.txt"
    # POSIX names may hold a backslash or end in a newline; only the segments matter.
    for odd in ("a\\b", "a/\n", "\n", "..\n", "...", ".a/b."):
        assert check_relative_path(odd, "x") == odd
    for bad in ("..", "a/..", "/a", "a/", "./a", "a//b", "a\x00b", "", None, 3):
        with pytest.raises(ValueError):
            check_relative_path(bad, "x")


def test_glob_matches_path_or_base_name() -> None:
    assert matches_any("a/b/c.txt", ["*.txt"])
    assert matches_any("a/b/c.txt", ["a/*"])
    assert not matches_any("a/b/c.txt", ["b/*"])
    assert matches_any("a/b", ["b"])


# ------------------------------------------------------------------------------------ fuzzing

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300))
def test_fuzz_manifest_bytes_give_only_value_errors(data: bytes) -> None:
    try:
        parse_manifest(data)
    except ValueError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(["version", "kind", "created", "files", "bytes", "objects", "packs",
                            "files_table", "metadata", "extra"]), value=_json)
def test_fuzz_manifest_fields_give_only_value_errors(key: str, value: object) -> None:
    manifest, _ = _docs()
    manifest[key] = value
    try:
        parse_manifest(json.dumps(manifest))
    except ValueError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(0, 2),
    key=st.sampled_from(["path", "size", "sha256", "mode", "mtime_ns", "group", "pack", "offset",
                         "object", "x"]),
    value=_json | st.text(alphabet="./a\x00", max_size=8),
)
def test_fuzz_entries_give_only_value_errors(index: int, key: str, value: object) -> None:
    manifest, lines = _docs()
    lines[index][key] = value
    try:
        entries = _parse(manifest, lines)
    except ValueError:
        return
    for e in entries:  # whatever got through is safe to join under a directory
        check_relative_path(e.path, "accepted path")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=400))
def test_fuzz_table_bytes_give_only_value_errors(data: bytes) -> None:
    entries = _entries()
    manifest = _manifest(entries, data)  # digest matches, so the gzip/JSON layers are exercised
    for blob in (data, gzip.compress(data)):
        manifest = _manifest(entries, blob)
        try:
            parse_files_table(blob, manifest)
        except ValueError:
            pass


def test_deeply_nested_json_is_a_clean_error() -> None:
    with pytest.raises(ValueError):
        parse_manifest(b"[" * 100_000)


def test_duplicate_fields_and_nan_are_refused_not_last_one_wins() -> None:
    manifest, lines = _docs()
    text = json.dumps(manifest)
    with pytest.raises(ValueError, match="manifest.json: not valid JSON .*'version' appears twice"):
        parse_manifest(text.replace('"version": 1', '"version": 1, "version": 1'))
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        parse_manifest(text.replace('"files": 3', '"files": NaN'))
    # A line naming its path twice could hide one of them from a reader who looks at the first.
    table = "".join(json.dumps(x) + "\n" for x in lines)
    table = table.replace('{"path": "a/one.txt"', '{"path": "../escape", "path": "a/one.txt"', 1)
    data = gzip.compress(table.encode())
    manifest["files_table"] = {
        "key": "files.jsonl.gz", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()
    }
    with pytest.raises(ValueError, match="files.jsonl.gz line 1: .*'path' appears twice"):
        parse_files_table(data, parse_manifest(json.dumps(manifest)))

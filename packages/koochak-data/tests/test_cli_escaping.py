"""koochak-data ls and ls --long escape control characters, so one file name cannot forge or
hide a listing line; --json keeps the exact names (issue 9)."""

from __future__ import annotations

import json

import pytest
from koochak.data.archive import archive_tree
from koochak.data.cli import _printable, main

NAMES = {
    "plain.txt": "plain.txt",
    "two\nlines.txt": "two\\nlines.txt",
    "fake\n0644          1 2020-01-01 00:00:00 deadbeefdead packs-x@512  forged": (
        "fake\\n0644          1 2020-01-01 00:00:00 deadbeefdead packs-x@512  forged"
    ),
    "tab\there": "tab\\there",
    "back\\slash": "back\\\\slash",
    "\x1b[31mred": "\\x1b[31mred",
    "cr\rover": "cr\\rover",
    "rlo\u202etxt.exe": "rlo\\u202etxt.exe",
    "sep\u2028line": "sep\\u2028line",
    "caf\u00e9 \u65e5\u672c": "caf\u00e9 \u65e5\u672c",  # printable Unicode is kept as it is
}


@pytest.fixture
def collection(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in NAMES:
        (src / name).write_bytes(name.encode())
    archive_tree(src, tmp_path / "coll")
    return tmp_path / "coll"


def test_escaping_is_one_line_and_reversible_for_each_name():
    for raw, shown in NAMES.items():
        assert _printable(raw) == shown
        assert "\n" not in shown and "\r" not in shown
        assert shown.encode().decode("unicode_escape") == raw or not shown.isascii()


@pytest.mark.parametrize("long", [False, True])
def test_ls_prints_one_escaped_line_per_file(collection, capsys, long):
    argv = ["ls", str(collection)] + (["--long"] if long else [])
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(NAMES)
    if long:
        for line in lines:
            assert sum(line.endswith("  " + shown) for shown in NAMES.values()) == 1, line
    else:
        assert sorted(lines) == sorted(NAMES.values())
    assert not any("\x1b" in line or "\u202e" in line for line in lines)


def test_ls_json_keeps_the_exact_names(collection, capsys):
    assert main(["ls", str(collection), "--json"]) == 0
    assert sorted(doc["path"] for doc in json.loads(capsys.readouterr().out)) == sorted(NAMES)


def test_ls_long_shows_an_mtime_no_calendar_can_hold(collection, capsys, tmp_path):
    import gzip
    import hashlib

    lines = gzip.decompress((collection / "files.jsonl.gz").read_bytes()).splitlines()
    docs = [json.loads(x) for x in lines]
    docs[0]["mtime_ns"] = 2**70
    table = gzip.compress("".join(json.dumps(d) + "\n" for d in docs).encode())
    manifest = json.loads((collection / "manifest.json").read_text())
    manifest["files_table"].update(size=len(table), sha256=hashlib.sha256(table).hexdigest())
    for name in ("files.jsonl.gz", "manifest.json"):
        (collection / name).unlink()
    (collection / "files.jsonl.gz").write_bytes(table)
    (collection / "manifest.json").write_text(json.dumps(manifest))
    assert main(["ls", str(collection), "--long"]) == 0
    assert f"mtime_ns={2**70}" in capsys.readouterr().out

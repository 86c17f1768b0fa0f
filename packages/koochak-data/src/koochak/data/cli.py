"""The ``koochak-data`` command: archive, pull, verify and ls for collections.

Each command prints a short human summary (or ``--json``), shows a tqdm bar only on a terminal,
and reports errors as one line on stderr with a non-zero exit (a traceback only with ``--debug``).
Exit codes: 0 done, 1 failed (including problems found by ``verify``), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import unicodedata
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _size(text: str) -> int:
    from koochak.storage.profile import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    common.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    bar = common.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show a progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false")

    parser = argparse.ArgumentParser(
        prog="koochak-data",
        description="Archive a tree into a collection of tar packs and objects, and pull, "
        "verify or list it.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    a = sub.add_parser("archive", parents=[common], help="pack a local tree into a collection")
    a.add_argument("src", metavar="SRC", help="local directory to archive")
    a.add_argument("dest", metavar="DEST", help="collection location: a path or scheme://path")
    a.add_argument("--groups", metavar="CSV", help="groups table: path,group[,order]")
    a.add_argument("--pack-bytes", type=_size, default=None, metavar="SIZE",
                   help="target pack size (default 64M)")
    a.add_argument("--object-bytes", type=_size, default=None, metavar="SIZE",
                   help="files at least this large become objects (default: from DEST's profile)")
    a.add_argument("--layout", choices=("packs", "objects"), default="packs",
                   help="'objects' stores every file as-is")
    a.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="archive only matching files (repeatable)")
    a.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip matching files; matching directories are pruned (repeatable)")
    a.add_argument("--skip-symlinks", action="store_true", help="skip symlinks instead of failing")
    a.add_argument("--min-age-hours", type=float, default=None, metavar="H",
                   help="skip files modified in the last H hours")
    a.add_argument("--files-from", metavar="LIST",
                   help="archive exactly the paths listed (one per line, relative to SRC)")
    a.add_argument("--delete-source", action="store_true",
                   help="after a deep verify of the committed collection, delete unchanged sources")
    a.add_argument("--dry-run", action="store_true", help="plan and report; write nothing")
    a.add_argument("--streams", type=_positive, default=None, help="packs written at once")

    p = sub.add_parser("pull", parents=[common], help="restore files from a collection")
    p.add_argument("src", metavar="SRC", help="collection location")
    p.add_argument("dest", metavar="DEST", help="local directory to restore into")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="restore only matching files (repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing files whose content differs")
    p.add_argument("--fsync", action="store_true", help="fsync every file before its rename")
    p.add_argument("--streams", type=_positive, default=None, help="requests in flight")

    v = sub.add_parser("verify", parents=[common], help="check a collection against its manifest")
    v.add_argument("src", metavar="SRC", help="collection location")
    v.add_argument("--deep", action="store_true", help="read every byte and check every SHA256")
    v.add_argument("--streams", type=_positive, default=None, help="packs/objects read at once")

    s = sub.add_parser("ls", parents=[common], help="list files from the manifest")
    s.add_argument("src", metavar="SRC", help="collection location")
    s.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="list only matching files (repeatable)")
    s.add_argument("--long", action="store_true", help="mode, size, mtime and location too")
    return parser


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover


_SHORT_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Control (Cc), format (Cf: bidi overrides, zero-width), line and paragraph separators.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _printable(text: str) -> str:
    r"""``text`` safe for one line of a listing: backslash and control characters escaped.

    ``\\``, ``\n``, ``\r``, ``\t``; other control, format (bidi overrides, zero-width) and
    line/paragraph separator characters as ``\xHH``, ``\uHHHH`` or ``\UHHHHHHHH``. Everything
    else (any printable Unicode) is kept, so a name cannot forge or hide a listing line and
    ``--json`` stays the exact form.
    """
    if text.isprintable() and "\\" not in text:
        return text  # the common case: one C-level scan
    out = []
    for char in text:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif unicodedata.category(char) in _UNPRINTABLE:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")  # fmt: skip
        else:
            out.append(char)
    return "".join(out)


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {_printable(str(value))}" for name, value in rows)


def _archive(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    from koochak.data.archive import DEFAULT_PACK_BYTES, archive_tree

    report = archive_tree(
        args.src, args.dest, groups=args.groups,
        pack_bytes=DEFAULT_PACK_BYTES if args.pack_bytes is None else args.pack_bytes,
        object_bytes=args.object_bytes,
        layout=args.layout, include=args.include, exclude=args.exclude,
        skip_symlinks=args.skip_symlinks, min_age_hours=args.min_age_hours,
        files_from=args.files_from, delete_source=args.delete_source, dry_run=args.dry_run,
        streams=args.streams, show_progress=args.progress,
    )
    state = "dry run (nothing written)" if report.dry_run else (
        "already committed" if report.already_committed else "committed"
    )
    # Reuse is only news for a run that wrote (or resumed writing) the collection.
    quiet = report.dry_run or report.already_committed
    reused_packs = "" if quiet else f", {report.packs_reused} reused"
    reused_objects = "" if quiet else f", {report.objects_reused} reused"
    skipped = [f"{n} {why.replace('_', ' ')}" for why, n in report.skipped.items() if n]
    req = report.requests
    rows: list[tuple[str, Any]] = [
        ("collection", report.dest),
        ("state", state),
        ("files", f"{report.files} ({_human(report.bytes)})"),
        ("packs", f"{report.packs} ({_human(report.pack_bytes)}){reused_packs}"),
        ("objects", f"{report.objects} ({_human(report.object_bytes)}){reused_objects}"),
        ("skipped", ", ".join(skipped) or "none"),
        ("requests", f"{req['target_puts']} puts to write it; a full pull takes "
                     f"{req['pull_gets']} gets ({req['pull_gets_unpacked']} if unpacked)"),
    ]
    if report.unmatched_group_rows:
        rows.append(("groups unmatched",
                     f"{report.unmatched_group_rows} row(s) of --groups name no archived file"))
        rows += [("  unmatched", path) for path in report.unmatched_group_paths[:5]]
    code = 0
    if args.delete_source and report.dry_run:
        rows.append(("sources", "kept: a dry run deletes nothing (a real run deletes them "
                                "after a deep verify)"))
    elif args.delete_source:
        rows.append(("deep verify", "ok" if report.verified else "FAILED: nothing deleted"))
        rows.append(("sources deleted", report.deleted))
        rows.append(("changed, kept", len(report.kept_changed)))
        rows += [("  kept", path) for path in report.kept_changed[:20]]
        rows += [("  problem", problem) for problem in report.problems[:20]]
        code = 0 if report.verified else 1
    return report.to_dict(), _table(rows), code


def _pull(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    from koochak.data.pull import pull_collection

    report = pull_collection(
        args.src, args.dest, include=args.include, overwrite=args.overwrite, fsync=args.fsync,
        streams=args.streams, show_progress=args.progress,
    )
    rows = [
        ("collection", report.source),
        ("destination", report.dest),
        ("selected", f"{report.files} files ({_human(report.bytes)})"),
        ("written", f"{report.written} files ({_human(report.bytes_written)})"),
        ("already present", report.present),
        ("requests", report.requests),
    ]
    if report.leftovers_removed:
        rows.append(("cleaned up", f"{report.leftovers_removed} temp file(s) of a killed pull"))
    return report.to_dict(), _table(rows), 0


def _verify(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    from koochak.data.verify import verify_collection

    report = verify_collection(
        args.src, deep=args.deep, streams=args.streams, show_progress=args.progress
    )
    rows: list[tuple[str, Any]] = [
        ("collection", report.location),
        ("check", "deep (every byte)" if report.deep else "sizes"),
        ("files", f"{report.files} ({_human(report.bytes)})"),
        ("packs", report.packs),
        ("objects", report.objects),
        ("bytes read", _human(report.bytes_read)),
        ("result", "ok" if report.ok else f"{len(report.problems)} problem(s)"),
    ]
    rows += [("  problem", str(p)) for p in report.problems[:50]]
    return report.to_dict(), _table(rows), 0 if report.ok else 1


def _ls(args: argparse.Namespace) -> tuple[Any, str, int]:
    from koochak.data.collection import load_collection

    entries = load_collection(args.src).select(args.include)
    docs = [
        {"path": e.path, "size": e.size, "sha256": e.sha256, "mode": e.mode,
         "mtime_ns": e.mtime_ns, "group": e.group, "key": e.key, "offset": e.offset}
        for e in entries
    ]
    if not args.long:
        return docs, "\n".join(_printable(e.path) for e in entries), 0
    lines = []
    for e in entries:
        where = _printable(f"{e.pack}@{e.offset}" if e.pack else e.key)
        lines.append(
            f"{e.mode:04o} {e.size:>12} {_when(e.mtime_ns)} {e.sha256[:12]} {where}  "
            f"{_printable(e.path)}"
        )
    return docs, "\n".join(lines), 0


def _when(mtime_ns: int) -> str:
    """UTC date and time of ``mtime_ns``; the raw number when no calendar date fits it."""
    import datetime  # only ls --long needs it

    try:
        when = datetime.datetime.fromtimestamp(mtime_ns / 1e9, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"mtime_ns={mtime_ns}"
    return f"{when:%Y-%m-%d %H:%M:%S}"


_COMMANDS = {"archive": _archive, "pull": _pull, "verify": _verify, "ls": _ls}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result, text, code = _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("koochak-data: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, TypeError) as exc:
        if args.debug:
            raise
        print(f"koochak-data {args.command}: error: {_printable(str(exc))}", file=sys.stderr)
        return 1
    try:
        if args.json:
            print(json.dumps(result, indent=1, sort_keys=True))
        elif text:
            print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # `koochak-data ls ... | head` closed the pipe: not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

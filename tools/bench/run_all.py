#!/usr/bin/env python3
"""Every benchmark at a size that fits about 10 minutes on 2 cores, as one table.

Runs each script of tools/bench as its own process (one at a time, so they do not slow each
other), reads the figures it prints (its ``--json`` output where it has one, its report lines
otherwise) and prints one table: measure, ratio against the baseline measured in the same run,
goal, met or not, the load average when that benchmark finished, and the commit. ``--markdown``
prints the table as the Markdown of docs/benchmarks.md's summary (``--write-docs`` puts it
there, between the ``run_all`` markers).

    python tools/bench/run_all.py                  # all of it: ~10 min on 2 idle cores, more under load
    python tools/bench/run_all.py --only loop,pull --markdown
    python tools/bench/run_all.py --write-docs     # regenerate the table in docs/benchmarks.md

A benchmark that fails or whose output no longer has a figure gives a row saying so instead of
stopping the others. Ratios are all "baseline time / ours" or "ours / baseline" as each goal
states it: the goal column says which, and which way is better.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- run_all: begin -->", "<!-- run_all: end -->"


@dataclass
class Row:
    measure: str
    ratio: float | None
    goal: str  # e.g. "<= 1.02x"
    note: str = ""
    load: float | None = None

    @property
    def met(self) -> bool | None:
        if self.ratio is None or self.goal == "-":
            return None
        op, value = self.goal.split()[:2]
        limit = float(value.rstrip("x"))
        return self.ratio <= limit if op == "<=" else self.ratio >= limit


@dataclass
class Bench:
    name: str
    argv: list[str]
    rows: Callable[[str], list[Row]]
    timeout: int


def _last_json(text: str) -> Any:
    """The last JSON document printed on its own lines (``--json`` output)."""
    decoder = json.JSONDecoder()
    starts = [m.start() + 1 for m in re.finditer(r"\n[\[{]", "\n" + text)]
    for start in reversed(starts):
        try:
            value, end = decoder.raw_decode(text, start - 1)
        except json.JSONDecodeError:
            continue
        if not text[end:].strip() or text[end:].lstrip().startswith("load average"):
            return value
    raise ValueError("no JSON document in the output")


def _loop_rows(text: str) -> list[Row]:
    figures = _last_json(text)
    rows = []
    for verdict in figures["verdicts"]:
        w = verdict["workload"]
        rows.append(Row(f"loop: per-update time vs a hand-written loop, {w} (best 50-step block)",
                        verdict["ratio"], f"<= {verdict['goal']:.2f}x",
                        f"median {verdict['median_ratio']:.3f}x", figures["load"]))  # fmt: skip
        for name, f in figures["figures"][w].items():
            if name in ("raw", "koochak"):
                continue
            rows.append(Row(f"loop: koochak vs {name}, {w} (best blocks; < 1 = koochak cheaper)",
                            verdict["ratio"] / f["best_ratio"], "<= 1.00x",
                            f"{name} {f['best_ratio']:.3f}x raw", figures["load"]))  # fmt: skip
    for label, raw_ops, koochak_ops in (r for r in figures.get("explain", []) if len(r) == 3):
        if label.startswith("bytecodes"):
            rows.append(Row("loop: Python bytecodes per update, koochak / raw loop (tiny; "
                            "deterministic)", koochak_ops / raw_ops, "-",
                            f"+{koochak_ops - raw_ops:.0f} per update", figures["load"]))  # fmt: skip
    return rows


def _shards_rows(text: str) -> list[Row]:
    f = _last_json(text)
    load = f["load_average"][0]
    rows = []
    for cache in ("warm", "cold"):
        rows.append(Row(f"shards: read_shard(verify=True) vs read + SHA256 on one core, {cache}",
                        f[f"{cache}_verified_vs_floor"], ">= 0.9x",
                        f"CPU {f[f'{cache}_verified_cpu_vs_floor']:.2f}x the floor's", load))  # fmt: skip
        rows.append(Row(f"shards: read_shards(prefetch={f['prefetch']}) vs the floor, {cache}",
                        f[f"{cache}_prefetch_vs_floor"], ">= 1.5x", "", load))  # fmt: skip
    return rows


def _pull_rows(text: str) -> list[Row]:
    results = _last_json(text)
    load = _load_in(text)
    rows = []
    for r in results:
        wall, cpu = r["wall"], r["cpu"]
        floor = wall["startup + import"] / wall["tar -xf"]
        # tar's kernel time per file shows the filesystem's state: right after a mass delete,
        # ext4 on this VM creates files up to 10x slower for minutes, and tar (all creation)
        # slows more than pull, so such a run flatters pull (about 50 us a file when settled).
        per_file = cpu["tar -xf"] / r["files"] * 1e6
        rows.append(Row(f"pull vs tar -xf, {r['files']:,} files (whole commands, wall)",
                        wall["pull"] / wall["tar -xf"], "<= 1.5x",
                        f"CPU {cpu['pull'] / cpu['tar -xf']:.2f}x; interpreter start + import "
                        f"alone {floor:.2f}x tar; tar {per_file:.0f} us CPU a file", load))  # fmt: skip
    return rows


def _tiers_rows(text: str) -> list[Row]:
    load = _load_in(text)
    rows = []
    faster = re.search(r"first tier\s+([0-9.]+)x faster from process start", text)
    rows.append(Row("recovery: first tier vs a 100 MB/s durable tier (process start to first step)",
                    float(faster.group(1)) if faster else None, ">= 5x",
                    "" if faster else "no figure in tiers_bench's output", load))  # fmt: skip
    slow = re.search(r"while replicating \(throttled\):\s+[0-9.]+ ms\s+([0-9.]+)x", text)
    rows.append(Row("replication: step wall time while a checkpoint replicates at 100 MB/s",
                    float(slow.group(1)) if slow else None, "<= 1.10x",
                    "" if slow else "no figure in tiers_bench's output", load))  # fmt: skip
    return rows


def _recovery_rows(text: str) -> list[Row]:
    """recovery_bench.py's medians: wall ratio against the floor, per layout (CPU in the note)."""
    load = _load_in(text)
    rows = []
    pattern = r"(one file|parts=\d+)\s+wall:.*?ratio ([0-9.]+)x.*?\n\s+CPU:.*?ratio ([0-9.]+)x"
    for label, wall, cpu in re.findall(pattern, text):
        rows.append(Row(f"recovery vs its floor, {label} (import torch + read + SHA256 + mmap "
                        "load + 1 step)", float(wall), "<= 1.25x", f"CPU {float(cpu):.2f}x",
                        load))  # fmt: skip
    return rows or [Row("recovery vs its floor", None, "<= 1.25x", "no figure", load)]


def _parts_rows(text: str) -> list[Row]:
    results = _last_json(text)
    load = (results.get("load_average_end") or [None])[0]
    rows = []
    for key, times in results.items():
        if not key.startswith(("disk ", "shm ")) or "koochak P=2" not in times:
            continue
        floor = times["raw+sha256 2 str."][0] / times["koochak P=2"][0]
        note = ""
        if len(times["koochak P=2"]) > 2 and len(times["koochak P=2"][2]) > 1:
            runs = [b / w for b, w in zip(times["raw+sha256 2 str."][2], times["koochak P=2"][2])]
            spread = [b / w for b, w in zip(times["raw+sha256 2 str."][2], times["raw 2 streams"][2])]
            note = (f"median of {len(runs)}; per run {min(runs):.2f}-{max(runs):.2f}x; the floor "
                    f"without its hash, per run: {min(spread):.2f}-{max(spread):.2f}x")  # fmt: skip
        rows.append(Row(f"parts save P=2 vs two hashed write+fsync streams, {key}", floor,
                        ">= 0.9x", note, load))  # fmt: skip
    return rows or [Row("parts save P=2 vs the hashed floor", None, ">= 0.9x", "no figure", load)]


def _load_in(text: str) -> float | None:
    found = re.findall(r"load(?: average)?(?: at the end)?:? ([0-9.]+)", text)
    return float(found[-1]) if found else None


def benches(py: str) -> list[Bench]:
    bench = lambda script: [py, str(HERE / script)]  # noqa: E731
    return [
        # Pull first: it is the one whose baseline (tar) the filesystem's state moves most.
        Bench("pull", bench("pull_bench.py") + ["--files", "4000", "--repeat", "3", "--json"],
              _pull_rows, 400),  # fmt: skip
        Bench("pull20k", bench("pull_bench.py") + ["--files", "20000", "--max-file", "8K",
              "--repeat", "2", "--json"], _pull_rows, 500),  # fmt: skip
        Bench("loop", bench("loop_overhead.py") + ["--anchors", "--explain", "--repeats", "5",
                                              "--json"],
              _loop_rows, 900),  # fmt: skip
        Bench("shards", bench("shards_bench.py") + ["--size", "128M", "--shard-bytes", "16M",
              "--repeat", "3", "--json"], _shards_rows, 300),  # fmt: skip
        Bench("tiers", bench("tiers_bench.py") + ["--size", "256M", "--rounds", "1"],
              _tiers_rows, 600),  # fmt: skip
        Bench("recovery", bench("recovery_bench.py") + ["--size", "256M", "--rounds", "2"],
              _recovery_rows, 500),  # fmt: skip
        # The sizes (1 and 4 GiB), 5 interleaved runs each: single runs on a virtual
        # disk move by 2x between neighbours, so one run cannot show a 0.9x goal either way.
        Bench("parts", bench("checkpoint_parts_bench.py") + ["--sizes", "1G,4G", "--layouts", "4",
              "--parts", "1,2", "--repeats", "5", "--skip", "load,async", "--shm-sizes", "1G",
              "--json"], _parts_rows, 900),  # fmt: skip
    ]


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(selected: list[Bench], log: Path | None) -> list[Row]:
    rows: list[Row] = []
    texts: dict[str, str] = {}
    for b in selected:
        started = time.perf_counter()
        print(f"run_all: {b.name}: {' '.join(Path(a).name if '/' in a else a for a in b.argv)}",
              file=sys.stderr, flush=True)  # fmt: skip
        try:
            proc = subprocess.run(b.argv, cwd=ROOT, text=True, capture_output=True,
                                  timeout=b.timeout)  # fmt: skip
            text = proc.stdout
            if log is not None:
                with log.open("a") as f:
                    f.write(f"==== {b.name} (exit {proc.returncode})\n{text}\n{proc.stderr}\n")
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}")
            rows += b.rows(text)
            texts[b.name] = text
        except Exception as exc:  # one benchmark's failure is a row, not the end of the run
            reason = str(exc)
            if isinstance(exc, subprocess.TimeoutExpired):
                reason = f"timed out after {b.timeout} s"
                if log is not None:
                    with log.open("a") as f:
                        f.write(f"==== {b.name} (timed out)\n{exc.stdout or ''}\n")
            rows.append(Row(f"{b.name}: not measured", None, "-", reason[:160],
                            os.getloadavg()[0]))  # fmt: skip
        print(f"run_all: {b.name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
    _bound_first_tier_ratio(rows, texts)
    return rows


def _bound_first_tier_ratio(rows: list[Row], texts: dict[str, str]) -> None:
    """Note on the first-tier row what its goal asks of the floor: the durable tier adds its
    transfer (durable - first, from tiers_bench) to the recovery, so the ratio is 1 + transfer /
    first; at recovery_bench's one-file floor (same size) it would be 1 + transfer / floor."""
    tiers, recovery = texts.get("tiers", ""), texts.get("recovery", "")
    first = re.search(r"first tier:\s+([0-9.]+) s", tiers)
    durable = re.search(r"from the durable store \([0-9.]+ MB/s\):\s+([0-9.]+) s", tiers)
    floor = re.search(r"one file\s+wall: floor\s+([0-9.]+) s", recovery)
    row = next((r for r in rows if r.measure.startswith("recovery: first tier vs")), None)
    if not (first and durable and floor and row):
        return
    transfer = float(durable.group(1)) - float(first.group(1))
    goal = float(row.goal.split()[1].rstrip("x"))
    # first / durable = 1 + transfer / first, so the goal needs first <= transfer / (goal - 1).
    row.note = (f"{row.goal.split()[1]} needs the first tier's recovery under "
                f"{transfer / (goal - 1):.1f} s (the durable tier adds {transfer:.1f} s); its "
                f"floor is {float(floor.group(1)):.1f} s, so at most "
                f"{1 + transfer / float(floor.group(1)):.2f}x at the floor")  # fmt: skip


def table(rows: list[Row], markdown: bool, head: str) -> str:
    def verdict(row: Row) -> str:
        return {None: "-", True: "met", False: "**missed**" if markdown else "MISSED"}[row.met]

    if markdown:
        lines = ["| measure | ratio | goal | met | load | note |", "|---|---|---|---|---|---|"]
        for r in rows:
            ratio = f"{r.ratio:.3f}x" if r.ratio is not None else "-"
            load = f"{r.load:.1f}" if r.load is not None else "-"
            lines.append(f"| {r.measure} | {ratio} | {r.goal} | {verdict(r)} | {load} | {r.note} |")
        return head + "\n\n" + "\n".join(lines)
    width = max(len(r.measure) for r in rows)
    lines = [head, f"{'measure':{width}}  {'ratio':>8}  {'goal':>9}  {'met':>6}  {'load':>5}  note"]
    for r in rows:
        ratio = f"{r.ratio:.3f}x" if r.ratio is not None else "-"
        load = f"{r.load:.1f}" if r.load is not None else "-"
        lines.append(f"{r.measure:{width}}  {ratio:>8}  {r.goal:>9}  {verdict(r):>6}  {load:>5}  "
                     f"{r.note}")  # fmt: skip
    return "\n".join(lines)


def write_docs(markdown: str) -> None:
    text = DOCS.read_text()
    block = f"{BEGIN}\n{markdown}\n{END}"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        title, _, rest = text.partition("\n")
        text = f"{title}\n\n## Every figure in one run (`tools/bench/run_all.py`)\n\n{block}\n{rest}"
    DOCS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in benches(sys.executable)]
    parser.add_argument("--only", default=None, help=f"comma-separated, of {', '.join(names)}")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--write-docs", action="store_true",
                        help="put the Markdown table into docs/benchmarks.md")  # fmt: skip
    parser.add_argument("--log", default=None, help="append every benchmark's output to this file")
    args = parser.parse_args(argv)
    selected = benches(sys.executable)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"--only: unknown {', '.join(sorted(unknown))}; choose from {names}")
        selected = [b for b in selected if b.name in wanted]
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    rows = run(selected, Path(args.log) if args.log else None)
    head = (f"commit {commit()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"{os.cpu_count()} cores, load average {load_start:.1f} at the start and "
            f"{os.getloadavg()[0]:.1f} at the end, {time.perf_counter() - started:.0f} s")  # fmt: skip
    print(table(rows, False, head))
    if args.markdown or args.write_docs:
        markdown = table(rows, True, head)
        if args.markdown:
            print("\n" + markdown)
        if args.write_docs:
            write_docs(markdown)
            print(f"run_all: wrote the table into {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

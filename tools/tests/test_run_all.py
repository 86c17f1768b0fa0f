"""tools/bench/run_all.py: each benchmark's output becomes table rows with the right verdict."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "tools" / "bench" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_goals_read_both_ways():
    run_all = _run_all()
    assert run_all.Row("m", 0.95, ">= 0.9x").met is True
    assert run_all.Row("m", 0.85, ">= 0.9x").met is False
    assert run_all.Row("m", 1.03, "<= 1.02x").met is False
    assert run_all.Row("m", 1.01, "<= 1.02x").met is True
    assert run_all.Row("m", None, "<= 1.02x").met is None
    assert run_all.Row("m", 1.0, "-").met is None


def test_parts_rows_give_the_median_and_the_per_run_spread():
    run_all = _run_all()
    times = {
        "koochak P=2": [1.0, 1.5, [1.0, 2.0, 0.5]],
        "raw+sha256 2 str.": [1.2, 1.0, [1.2, 1.0, 1.5]],
        "raw 2 streams": [0.6, 0.3, [0.6, 0.4, 3.0]],
    }
    text = "disk, 1.00 GiB\n" + json.dumps(
        {"load_average_start": [0.4], "disk 1.00 GiB as 4 tensors": times,
         "load_average_end": [0.7]}  # fmt: skip
    )
    [row] = run_all._parts_rows(text)
    assert row.ratio == 1.2 and row.met is True and row.load == 0.7
    assert "median of 3" in row.note
    assert "per run 0.50-3.00x" in row.note  # 1.0/2.0 .. 1.5/0.5
    assert "0.50-2.50x" in row.note  # the floor without its hash: 1.5/3.0 .. 1.0/0.4


def test_a_benchmark_without_figures_gives_a_row_saying_so():
    run_all = _run_all()
    [row] = run_all._parts_rows('{"load_average_end": [1.0]}')
    assert row.ratio is None and row.met is None and row.note == "no figure"


def test_the_first_tier_row_says_how_far_its_floor_lets_it_go():
    run_all = _run_all()
    tiers = ("recovery, process start -> first resumed step, first tier:     4.0 s  (after ...)\n"
             "recovery from the durable store (100 MB/s):          6.7 s  (after ...)\n"
             "  -> first tier  1.7x faster from process start,  2.0x after imports\n")
    recovery = "  one file  wall: floor   3.00 s  koochak   2.50 s  ratio 0.83x (rounds ...)\n"
    rows = run_all._tiers_rows(tiers)
    run_all._bound_first_tier_ratio(rows, {"tiers": tiers, "recovery": recovery})
    first = rows[0]
    assert first.ratio == 1.7 and first.met is False
    # 5x needs first <= 2.7 / 4; at the floor of 3.0 s: 1 + 2.7 / 3.0
    assert first.note.startswith("5x needs the first tier's recovery under 0.7 s")
    assert first.note.endswith("at most 1.90x at the floor")

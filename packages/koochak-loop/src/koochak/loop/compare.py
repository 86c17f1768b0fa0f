"""``koochak-report RUN RUN [...]``: several runs side by side (a sweep, a baseline and a change).

Each run is read as the single-run report reads it (`koochak.loop.report.gather_run`: the metric
log, the run history, ``config.yaml``). The figure overlays their loss curves (and each
``eval_*`` curve, dotted), one colour per run, each labelled by the config keys whose values
differ between the runs (``optim.optimizer.lr=0.003``), so a three-learning-rate sweep reads
as three named curves. The page adds a table per run: those keys, the final and best loss, the
best of each eval metric, the last step, wall time (first attempt's start to the last's end,
restarts included) and goodput (useful steps over that wall time, as the run recorded it).

A step that an attempt redid after a restart is drawn with the later attempt's value: each
run is one curve.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from koochak.loop.config import flat_config
from koochak.loop.report import RunData, gather_run, load_pyplot, write_output
from koochak.loop.run_history import format_duration

__all__ = ["differing_keys", "build_comparison", "run_summary", "write_comparison"]

# Keys that differ between any two runs without making them different experiments.
_PLACES = ("out_dir", "checkpoint_dir", "checkpoint_replicas", "csv_path", "jsonl_path",
           "tensorboard_dir", "run_id", "name")  # fmt: skip
_LEGEND_KEYS = 3


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The dotted config keys whose values are not the same in every one of ``configs`` (where
    the runs are kept does not count)."""
    flat = [flat_config(config) for config in configs]
    keys = sorted(set().union(*flat)) if flat else []
    missing = object()
    found = []
    for key in keys:
        if key.rsplit(".", 1)[-1] in _PLACES:
            continue
        values = [repr(f.get(key, missing)) for f in flat]
        if len(set(values)) > 1:
            found.append(key)
    return found


def _label(data: RunData, keys: Sequence[str]) -> str:
    flat = flat_config(data.config)
    shown = [f"{key}={flat.get(key)}" for key in keys[:_LEGEND_KEYS]]
    more = f" (+{len(keys) - _LEGEND_KEYS} keys)" if len(keys) > _LEGEND_KEYS else ""
    return f"{data.run_dir.name}: " + (", ".join(shown) + more if shown else "same config")


def _curve(data: RunData, name: str, evals: bool = False) -> list[tuple[int, float]]:
    """``(step, value)`` of metric ``name`` over all attempts, a redone step taking the later
    attempt's value."""
    points: dict[int, float] = {}
    for attempt in data.attempts:
        for row in attempt.evals if evals else attempt.rows:
            value = row.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                points[int(row["step"])] = float(value)
    return sorted(points.items())


def run_summary(data: RunData) -> dict[str, Any]:
    """The table row of one run: final/best loss, best eval metrics, last step, wall time and
    goodput."""
    loss = [v for _, v in _curve(data, "loss") if math.isfinite(v)]
    out: dict[str, Any] = {"run": str(data.run_dir), "final_loss": loss[-1] if loss else None,
                           "best_loss": min(loss) if loss else None}  # fmt: skip
    names = sorted({k for a in data.attempts for r in a.evals for k in r if k.startswith("eval_")})
    for name in names:
        values = [v for _, v in _curve(data, name, evals=True) if math.isfinite(v)]
        if values:
            best = max(values) if "acc" in name else min(values)
            out[f"best_{name}"] = best
    steps = [int(r["step"]) for a in data.attempts for r in a.rows]
    out["last_step"] = max(steps) + 1 if steps else None
    end = data.end or {}
    starts = [a.start_time for a in data.attempts if a.start_time]
    ends = [a.end_time for a in data.attempts if a.end_time]
    wall = end.get("wall_s")
    if not isinstance(wall, (int, float)) and starts and ends:
        wall = max(ends) - min(starts)
    out["wall_s"] = float(wall) if isinstance(wall, (int, float)) else None
    goodput = end.get("goodput")
    out["goodput"] = float(goodput) if isinstance(goodput, (int, float)) else None
    out["attempts"] = len(data.attempts)
    return out


def build_comparison(runs: Sequence[RunData]) -> Any:
    """The figure: every run's loss (solid) and eval curves (dotted) over steps, one colour per
    run, labelled by the differing keys. Artists carry ``gid`` ``loss-run<i>`` and
    ``<eval_name>-run<i>``."""
    plt = load_pyplot()
    keys = differing_keys([r.config for r in runs])
    fig, ax = plt.subplots(1, 1, figsize=(11, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, data in enumerate(runs):
        color = colors[i % len(colors)]
        points = _curve(data, "loss")
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], color=color,
                    label=_label(data, keys), gid=f"loss-run{i}")  # fmt: skip
        names = sorted({k for a in data.attempts for r in a.evals for k in r
                        if k.startswith("eval_")})  # fmt: skip
        for name in names:
            points = _curve(data, name, evals=True)
            ax.plot([s for s, _ in points], [v for _, v in points], color=color, linestyle=":",
                    marker="o", markersize=3, label=f"{name} ({data.run_dir.name})",
                    gid=f"{name}-run{i}")  # fmt: skip
    ax.set_title(f"{len(runs)} runs: loss (solid) and eval (dotted) by step; legend: what differs")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if ax.get_lines():
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_comparison(
    run_dirs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str] | None = None
) -> tuple[Path, Path]:
    """Write ``<out>.png`` and ``<out>.html`` (default ``./koochak-compare``); their paths."""
    runs = [gather_run(run_dir) for run_dir in run_dirs]
    fig = build_comparison(runs)
    prefix = Path(out) if out is not None else Path("koochak-compare")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    png, page = prefix.with_name(prefix.name + ".png"), prefix.with_name(prefix.name + ".html")
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    load_pyplot().close(fig)
    keys = differing_keys([r.config for r in runs])
    rows = [run_summary(r) for r in runs]
    metrics = ["final_loss", "best_loss"] + sorted({k for r in rows for k in r
                                                    if k.startswith("best_eval_")})  # fmt: skip
    head = ["run", *keys, *metrics, "last_step", "attempts", "wall time", "goodput"]
    body = []
    for data, row in zip(runs, rows):
        flat = flat_config(data.config)
        cells = [data.run_dir.name, *[_cell(flat.get(k)) for k in keys],
                 *[_cell(row.get(m)) for m in metrics], _cell(row["last_step"]),
                 _cell(row["attempts"]), format_duration(row["wall_s"]),
                 f"{row['goodput']:.0%}" if row["goodput"] is not None else "—"]  # fmt: skip
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    table = ("<table border='1' cellpadding='4'><tr>"
             + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
             + "".join(body) + "</table>")  # fmt: skip
    encoded = base64.b64encode(image.getvalue()).decode("ascii")
    listed = "".join(f"<li>{html.escape(str(r.run_dir))}</li>" for r in runs)
    text = (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>koochak runs compared ({len(runs)})</title></head><body>"
        f"<h1>{len(runs)} runs compared</h1><ul>{listed}</ul>{table}"
        f"<img alt='loss and eval curves of every run' src='data:image/png;base64,{encoded}'>"
        "</body></html>\n"
    )
    write_output(png, image.getvalue())
    write_output(page, text.encode("utf-8"))
    return png, page

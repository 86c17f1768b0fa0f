"""``koochak-report RUN_DIR [--out PREFIX]``: one self-contained picture of a run, all attempts.

Reads what a koochak-train run leaves in its run directory (``train.out_dir``): the metric log
(``log.jsonl``, else ``log.csv``), the run history (``attempts.jsonl``), the resolved config
(``config.yaml``, for the checkpoint tiers) and each tier's checkpoints (their ready manifests'
commit times). Writes ``report.png`` and ``report.html`` (the PNG embedded as base64, with the
summary and what the run's files did not record) beside them, or at ``--out PREFIX``:

- loss (and every ``eval_*`` curve) over the steps of all attempts, a dashed restart marker at
  each attempt's first step, labelled with how the previous attempt ended;
- tokens/s (else samples/s) and MFU per logged row;
- a checkpoint timeline per tier: commit times over the run's wall clock, the attempts as bands,
  each replica commit joined to the first tier's with its lag.

matplotlib is the ``report`` extra (``pip install 'koochak-loop[report]'``), imported only here.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import io
import json
import os
import secrets
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunData", "build_figure", "gather_run", "main", "write_report"]

EXIT_USAGE = 2
_READY = ".ready.json"


class ReportError(ValueError):
    """A run directory the report cannot be made from (one line, exit 2)."""


@dataclass
class Attempt:
    number: int
    start_step: int
    record: dict[str, Any] = field(default_factory=dict)  # the attempt record (log or history)
    rows: list[dict[str, Any]] = field(default_factory=list)  # log rows: {"step", **metrics}
    evals: list[dict[str, Any]] = field(default_factory=list)
    start_time: float | None = None
    end_time: float | None = None
    end_reason: str | None = None


@dataclass
class TierCommits:
    index: int
    location: str
    commits: dict[int, float] = field(default_factory=dict)  # step -> commit time (unix s)
    error: str | None = None


@dataclass
class RunData:
    run_dir: Path
    attempts: list[Attempt]
    tiers: list[TierCommits]
    end: dict[str, Any] | None
    missing: list[str]

    def lags(self, tier: int) -> list[float]:
        """Seconds from the first tier's commit to tier ``tier``'s, per checkpoint both hold."""
        first, other = self.tiers[0].commits, self.tiers[tier].commits
        return [other[s] - first[s] for s in sorted(set(first) & set(other))]


# ----------------------------------------------------------------------------- reading


def _read_metric_log(run_dir: Path, missing: list[str]) -> list[dict[str, Any]]:
    from koochak.loop.logging import read_csv_log, read_jsonl_log

    jsonl, csv_path = run_dir / "log.jsonl", run_dir / "log.csv"
    if jsonl.exists():
        try:
            return read_jsonl_log(jsonl)
        except ValueError:  # a line torn by a kill: keep every whole one
            records, bad = [], 0
            for line in jsonl.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                    records.append({k: record[k] for k in ("event", "step", "time", "metrics")})
                except (ValueError, KeyError, TypeError):
                    bad += 1
            missing.append(f"{bad} unreadable line(s) of log.jsonl skipped")
            return records
    if csv_path.exists():
        missing.append("log.jsonl absent: the attempt records are their CSV note only")
        return read_csv_log(csv_path)
    raise ReportError(f"{run_dir}: no log.jsonl or log.csv (is this a koochak-train run "
                      "directory, train.out_dir?)")  # fmt: skip


def _split_attempts(records: list[dict[str, Any]], missing: list[str]) -> tuple[list[Attempt], Any]:
    attempts: list[Attempt] = []
    end = None
    for record in records:
        event, step, metrics = record["event"], int(record["step"]), record["metrics"]
        if event == "attempt":
            number = int(metrics.get("attempt", len(attempts) + 1))
            attempts.append(Attempt(number, step, dict(metrics), start_time=record.get("time")))
            continue
        if not attempts:  # rows written before attempt records existed
            missing.append("the log starts without an attempt record (an older koochak)")
            attempts.append(Attempt(1, step, start_time=record.get("time")))
        if event == "log":
            attempts[-1].rows.append({"step": step, **metrics})
        elif event == "eval":
            attempts[-1].evals.append({"step": step, **metrics})
        elif event == "end":
            end = dict(metrics)
            attempts[-1].end_reason = attempts[-1].end_reason or "ended"
    return attempts, end


def _apply_history(run_dir: Path, attempts: list[Attempt], missing: list[str]) -> None:
    from koochak.loop.run_history import read_history

    history = read_history(run_dir)
    if not history:
        missing.append("attempts.jsonl absent: attempt wall times are the log's")
    by_number = {a.number: a for a in attempts}
    for record in history:
        attempt = by_number.get(int(record.get("attempt") or 0))
        if attempt is None:
            continue
        when = record.get("time")
        if record.get("event") == "start" and when is not None:
            attempt.start_time = float(when)
        if record.get("event") in ("progress", "end") and when is not None:
            attempt.end_time = max(attempt.end_time or 0.0, float(when))
        if record.get("event") == "end":
            attempt.end_reason = str(record.get("reason"))
    for attempt in attempts:
        if attempt.end_time is None:
            times = [r.get("time") for r in attempt.rows if r.get("time")]
            attempt.end_time = max(times) if times else attempt.start_time
        if attempt.end_reason is None and attempt is not attempts[-1]:
            nxt = attempts[attempts.index(attempt) + 1]
            attempt.end_reason = str(nxt.record.get("previous_end") or "crashed")


def _tier_locations(run_dir: Path, missing: list[str]) -> list[Any]:
    import yaml

    config = run_dir / "config.yaml"
    if not config.exists():
        missing.append("config.yaml absent: only the run directory is read as a checkpoint tier")
        return [str(run_dir)]
    try:
        from koochak.loop.checkpoint.tiers import checkpoint_locations

        train = dict((yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("train") or {})
        train.setdefault("out_dir", str(run_dir))
        return list(checkpoint_locations(train))
    except Exception as exc:  # noqa: BLE001 - a report shows what it can
        missing.append(f"config.yaml's tiers unreadable ({type(exc).__name__}: {exc})")
        return [str(run_dir)]


def _tier_commits(locations: list[Any], missing: list[str]) -> list[TierCommits]:
    from koochak.loop.checkpoint import checkpoint_store
    from koochak.loop.checkpoint.format import step_of_name

    tiers = []
    for index, location in enumerate(locations):
        tier = TierCommits(index, str(getattr(location, "location", location)))
        try:
            for info in checkpoint_store(location).list():
                if not info.key.endswith(_READY):
                    continue
                step = step_of_name(info.key[: -len(_READY)].rsplit("/", 1)[-1])
                if step is not None:
                    tier.commits[step] = info.mtime_ns / 1e9
        except Exception as exc:  # noqa: BLE001 - one unreachable tier does not stop the report
            tier.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            missing.append(f"tier {index} ({tier.location}) could not be listed: {tier.error}")
        tiers.append(tier)
    missing.append("checkpoints pruned by retention (keep_last_k) are not on the timeline; "
                   "commit times are the ready manifests' modification times")  # fmt: skip
    return tiers


def gather_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Everything the report shows, read from ``run_dir`` (and its checkpoint tiers)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ReportError(f"{root}: not a directory (give koochak-report a run's train.out_dir)")
    missing: list[str] = []
    attempts, end = _split_attempts(_read_metric_log(root, missing), missing)
    if not attempts:
        raise ReportError(f"{root}: the metric log holds no rows yet")
    _apply_history(root, attempts, missing)
    tiers = _tier_commits(_tier_locations(root, missing), missing)
    return RunData(root, attempts, tiers, end, missing)


# ----------------------------------------------------------------------------- drawing


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("koochak-report needs matplotlib: pip install 'koochak-loop[report]'") from None
    return plt


def restart_label(attempt: Attempt) -> str:
    """What a restart marker says: the attempt, how the previous ended, where it resumed."""
    record = attempt.record
    previous = record.get("previous_end")
    text = f"attempt {attempt.number}"
    if previous:
        text += f": previous {previous}"
        if record.get("previous_step") is not None:
            text += f" after step {record['previous_step']}"
    if record.get("resumed_tier") is not None:
        text += f", resumed at {attempt.start_step} from tier {record['resumed_tier']}"
    elif "resumed_from" not in record and previous:
        text += ", restarted from step 0"
    return text


def _markers(ax: Any, attempts: list[Attempt], labels: bool) -> None:
    for attempt in attempts[1:]:
        ax.axvline(attempt.start_step, color="#d62728", linestyle="--", linewidth=1.2,
                   gid=f"restart-{attempt.number}" + ("" if labels else "-rate"))  # fmt: skip
        if labels:
            ax.annotate(restart_label(attempt), (attempt.start_step, 0.03),
                        xycoords=("data", "axes fraction"), xytext=(4, 0),
                        textcoords="offset points", va="bottom", ha="left", fontsize=8,
                        color="#d62728", gid=f"restart-label-{attempt.number}",
                        bbox={"boxstyle": "round", "fc": "white", "ec": "#d62728",
                              "alpha": 0.85})  # fmt: skip


def build_figure(data: RunData) -> Any:
    """The report's figure (matplotlib), every artist tagged with a ``gid`` tests can find:
    ``loss-<attempt>``, ``eval_<name>-<attempt>``, ``restart-<attempt>``, ``tokens_per_s-<n>``
    / ``samples_per_s-<n>``, ``mfu-<n>``, ``commits-tier<k>``, ``lag-tier<k>``."""
    plt = _pyplot()
    fig, (loss_ax, rate_ax, ckpt_ax) = plt.subplots(3, 1, figsize=(11, 11.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    attempts = data.attempts

    # -- loss and eval curves, all attempts
    for i, attempt in enumerate(attempts):
        color = colors[i % len(colors)]
        rows = [r for r in attempt.rows if isinstance(r.get("loss"), (int, float))]
        if rows:
            loss_ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color,
                         label=f"loss (attempt {attempt.number})", gid=f"loss-{attempt.number}")  # fmt: skip
        names = sorted({k for r in attempt.evals for k in r if k.startswith("eval_")})
        for name in names:
            points = [r for r in attempt.evals if isinstance(r.get(name), (int, float))]
            loss_ax.plot([r["step"] for r in points], [r[name] for r in points], marker="o",
                         linestyle=":", color=color, label=f"{name} (attempt {attempt.number})",
                         gid=f"{name}-{attempt.number}")  # fmt: skip
    _markers(loss_ax, attempts, labels=True)
    loss_ax.set_title(f"{data.run_dir.name}: loss over {len(attempts)} attempt(s)")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    if loss_ax.get_lines():
        loss_ax.legend(fontsize=8, loc="upper right")

    # -- throughput and MFU
    rate = "tokens_per_s" if any("tokens_per_s" in r for a in attempts for r in a.rows) else (
        "samples_per_s")  # fmt: skip
    mfu_ax = rate_ax.twinx()
    for i, attempt in enumerate(attempts):
        color = colors[i % len(colors)]
        rows = [r for r in attempt.rows if isinstance(r.get(rate), (int, float))]
        rate_ax.plot([r["step"] for r in rows], [r[rate] for r in rows], color=color,
                     label=f"{rate} (attempt {attempt.number})", gid=f"{rate}-{attempt.number}")  # fmt: skip
        mfus = [r for r in attempt.rows if isinstance(r.get("mfu"), (int, float))]
        if mfus:
            mfu_ax.plot([r["step"] for r in mfus], [100 * r["mfu"] for r in mfus], color="black",
                        linestyle="--", linewidth=0.9, gid=f"mfu-{attempt.number}")  # fmt: skip
    _markers(rate_ax, attempts, labels=False)
    rate_ax.set_xlabel("step")
    rate_ax.set_ylabel(rate.replace("_per_s", "/s"))
    mfu_ax.set_ylabel("MFU % (black, dashed)")
    rate_ax.set_title("throughput" + (" and MFU" if mfu_ax.get_lines() else " (no MFU logged)"))

    # -- checkpoint timeline per tier
    origin = min([a.start_time for a in attempts if a.start_time] +
                 [t for tier in data.tiers for t in tier.commits.values()] or [0.0])  # fmt: skip
    for i, attempt in enumerate(attempts):
        if attempt.start_time and attempt.end_time:
            ckpt_ax.axvspan(attempt.start_time - origin, attempt.end_time - origin,
                            color=colors[i % len(colors)], alpha=0.12,
                            gid=f"attempt-span-{attempt.number}")  # fmt: skip
            ckpt_ax.annotate(f"attempt {attempt.number} ({attempt.end_reason or 'running'})",
                             (attempt.start_time - origin, len(data.tiers) - 0.45), fontsize=8)
    first = data.tiers[0].commits if data.tiers else {}
    for tier in data.tiers:
        steps = sorted(tier.commits)
        ckpt_ax.plot([tier.commits[s] - origin for s in steps], [tier.index] * len(steps), "o",
                     color=colors[tier.index % len(colors)], gid=f"commits-tier{tier.index}")  # fmt: skip
        for step in steps:
            ckpt_ax.annotate(str(step), (tier.commits[step] - origin, tier.index),
                             xytext=(0, 6), textcoords="offset points", fontsize=7, ha="center")
        if tier.index > 0:
            both = [s for s in steps if s in first]
            for n, step in enumerate(both):
                ckpt_ax.plot([first[step] - origin, tier.commits[step] - origin], [0, tier.index],
                             color="gray", linewidth=0.8,
                             gid=f"lag-tier{tier.index}" if n == 0 else None)  # fmt: skip
    ckpt_ax.set_yticks([t.index for t in data.tiers],
                       [_tier_tick(data, t) for t in data.tiers], fontsize=8)  # fmt: skip
    ckpt_ax.set_ylim(-0.5, max(len(data.tiers) - 0.3, 0.7))
    ckpt_ax.set_xlabel("seconds since the first attempt began")
    ckpt_ax.set_title("checkpoint commits per tier (step numbers; gray: replication lag)")
    fig.text(0.01, 0.005, "\n".join(summary_lines(data)[:4]), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _tier_tick(data: RunData, tier: TierCommits) -> str:
    where = tier.location if len(tier.location) <= 28 else "..." + tier.location[-25:]
    text = f"tier {tier.index}\n{where}"
    lags = data.lags(tier.index) if tier.index else []
    if lags:
        text += f"\nlag med {statistics.median(lags):.1f} s, max {max(lags):.1f} s"
    return text


def summary_lines(data: RunData) -> list[str]:
    lines = []
    for attempt in data.attempts:
        steps = [r["step"] for r in attempt.rows]
        span = f"steps {min(steps)}..{max(steps)}" if steps else "no logged rows"
        lines.append(f"attempt {attempt.number}: from step {attempt.start_step}, {span}, "
                     f"ended {attempt.end_reason or 'running or unknown'}")  # fmt: skip
    if data.end and data.end.get("note"):
        lines.append(str(data.end["note"]))
    elif data.end:
        lines.append("end: " + ", ".join(f"{k}={v}" for k, v in data.end.items()))
    for tier in data.tiers[1:]:
        lags = data.lags(tier.index)
        if lags:
            lines.append(f"tier {tier.index} ({tier.location}): {len(lags)} checkpoint(s), "
                         f"replication lag median {statistics.median(lags):.2f} s, "
                         f"max {max(lags):.2f} s")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------- writing


def write_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 ) -> tuple[Path, Path]:  # fmt: skip
    """Write ``<out>.png`` and ``<out>.html`` (default ``RUN_DIR/report``); their paths."""
    data = gather_run(run_dir)
    fig = build_figure(data)
    prefix = Path(out) if out is not None else data.run_dir / "report"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    png, page = prefix.with_name(prefix.name + ".png"), prefix.with_name(prefix.name + ".html")
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    _pyplot().close(fig)
    encoded = base64.b64encode(image.getvalue()).decode("ascii")
    items = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(data))
    gaps = "".join(f"<li>{html.escape(line)}</li>" for line in data.missing)
    text = (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>koochak run report: {html.escape(str(data.run_dir))}</title></head><body>"
        f"<h1>Run report: {html.escape(str(data.run_dir))}</h1><ul>{items}</ul>"
        f"<img alt='loss, throughput and checkpoint timeline' "
        f"src='data:image/png;base64,{encoded}'>"
        f"<h2>Not recorded by the run's files</h2><ul>{gaps}</ul></body></html>\n"
    )
    write_output(png, image.getvalue())
    write_output(page, text.encode("utf-8"))
    return png, page


def write_output(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` without ever writing through a link planted there: a new file
    is created (``O_CREAT | O_EXCL | O_NOFOLLOW``, relative to the directory opened once) under
    a hidden name, synced, and renamed over ``path`` — a rename replaces a symlink itself, never
    the file it points to."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    directory = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    temp = f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temp, flags, 0o644, dir_fd=directory)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=directory)
            raise
    finally:
        os.close(directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="koochak-report",
        description="Render a koochak-train run directory (all attempts) as a PNG and an HTML page.",
    )
    parser.add_argument("run_dir", help="the run's train.out_dir")
    parser.add_argument("--out", default=None, help="output prefix (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        png, page = write_report(args.run_dir, args.out)
    except (ReportError, OSError) as exc:
        print(f"koochak-report: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    print(f"koochak-report: wrote {png} and {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

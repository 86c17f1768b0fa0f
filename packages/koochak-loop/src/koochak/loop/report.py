"""``koochak-report RUN_DIR [RUN_DIR ...] [--out PREFIX]``: one self-contained picture of a run,
all attempts (several runs: side by side, `koochak.loop.compare`).

Reads what a koochak-train run leaves in its run directory (``train.out_dir``): the metric log
(``log.jsonl``, else ``log.csv``) for the curves, and the run history (``attempts.jsonl``) for
the story: how each attempt ended (a lost node, a requeue), what it resumed from, every
checkpoint commit per tier and every replication with its lag, pruned since or not. The tiers
(from ``config.yaml``) are listed only to add what the history lacks (a run of an older
Koochak) and to say which commits are still there; a tier that cannot be listed from here (a
node-local disk, an S3 tier without its endpoint) costs nothing the history holds. It works
from the submitting host, mid-run and after pruning. Writes ``report.png`` and
``report.html`` (the PNG embedded as base64, with the story, the commits and what the run's
files did not record) beside them, or at ``--out PREFIX``:

- loss (and every ``eval_*`` curve) over the steps of all attempts, a dashed restart marker at
  each attempt's first step, labelled with how the previous attempt ended;
- tokens/s (else samples/s) and MFU per logged row;
- a checkpoint timeline per tier: commit times over the run's wall clock (hollow: pruned since),
  the attempts as bands labelled with how each ended, each replica commit joined to the first
  tier's with its lag, and a star on the commit each attempt resumed from.

``koochak-report RUN [RUN ...]`` with several runs compares them instead (`koochak.loop.compare`).

matplotlib is the ``report`` extra (``pip install 'koochak-loop[report]'``), imported only here.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import json
import os
import secrets
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunData", "build_figure", "gather_run", "write_report"]

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
    failure: str | None = None  # how it ended, for people ("node2 lost: rank 1 ...")
    resumed: dict[str, Any] | None = None  # {"tier", "step", "path", "passed_over"}
    origin: dict[str, Any] | None = None  # train.init_from's {"path", "sha256", "ema"}


@dataclass
class TierCommits:
    index: int
    location: str
    commits: dict[int, float] = field(default_factory=dict)  # step -> commit time (unix s)
    error: str | None = None
    present: set[int] | None = None  # steps committed there now (None: not listed)
    pruned_recorded: set[int] = field(default_factory=set)  # the history's prune records

    @property
    def pruned(self) -> list[int]:
        """Commits no longer there: what a listing of the tier lacks, else what the history
        says its retention removed."""
        if self.present is None:
            return sorted(self.pruned_recorded & set(self.commits))
        return sorted(set(self.commits) - self.present)


@dataclass
class RunData:
    run_dir: Path
    attempts: list[Attempt]
    tiers: list[TierCommits]
    end: dict[str, Any] | None
    missing: list[str]
    replications: list[dict[str, Any]] = field(default_factory=list)  # the history's
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml (for comparisons)
    supersedes: list[dict[str, Any]] = field(default_factory=list)  # older runs moved aside

    def lags(self, tier: int) -> list[float]:
        """Seconds from the first tier's commit to tier ``tier``'s, per checkpoint: as the run
        recorded them (its replications), else from both tiers' commit times."""
        recorded = {int(r["step"]): float(r["lag_s"]) for r in self.replications
                    if r.get("tier") == tier and r.get("status") == "committed"
                    and r.get("lag_s") is not None and r.get("step") is not None}  # fmt: skip
        first, other = self.tiers[0].commits, self.tiers[tier].commits
        both = set(first) & set(other) | set(recorded)
        return [recorded[s] if s in recorded else other[s] - first[s] for s in sorted(both)]


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


def _apply_history(run_dir: Path, attempts: list[Attempt], missing: list[str]) -> list[Any]:
    """The history's story onto the attempts (times, how each ended, what it resumed from);
    returns the history's records."""
    from koochak.loop.run_history import read_history

    history = read_history(run_dir)
    if not history:
        missing.append("attempts.jsonl absent: attempt wall times are the log's, commits the "
                       "tiers' (pruned ones are lost)")  # fmt: skip
    by_number = {a.number: a for a in attempts}
    for record in history:
        number = int(record.get("attempt") or 0)
        event, when = record.get("event"), record.get("time")
        if event == "start" and number not in by_number:  # an attempt that logged no row
            by_number[number] = Attempt(number, int(record.get("step") or 0), {})
            attempts.append(by_number[number])
        attempt = by_number.get(number)
        if attempt is None:
            continue
        if event == "start" and when is not None:
            attempt.start_time = float(when)
            if isinstance(record.get("origin"), dict) and record["origin"].get("path"):
                attempt.origin = record["origin"]
            if record.get("resumed_from") and attempt.resumed is None:
                attempt.resumed = {"tier": record.get("resumed_tier"), "path":
                                   record.get("resumed_from")}  # fmt: skip
            previous = record.get("previous") or {}
            before = by_number.get(number - 1)
            if previous.get("failure"):  # what the restart marker says (the log's record lacks it)
                attempt.record.setdefault("previous_failure", str(previous["failure"]))
            if before is not None and previous.get("failure"):
                before.failure = str(previous["failure"])
            if before is not None and previous.get("end"):
                lost = previous["end"] == "node_lost"  # outranks the "failed" rank 0 wrote
                if before.end_reason is None or lost:
                    before.end_reason = str(previous["end"])
        if event in ("progress", "end", "commit") and when is not None:
            attempt.end_time = max(attempt.end_time or 0.0, float(when))
        if event == "end":
            attempt.end_reason = str(record.get("reason"))
            if record.get("error") and attempt.failure is None:
                attempt.failure = str(record["error"])
        if event == "resume" and record.get("step") is not None:
            attempt.resumed = {"tier": record.get("tier"), "step": int(record["step"]),
                               "path": record.get("path"),
                               "passed_over": record.get("passed_over") or []}  # fmt: skip
    attempts.sort(key=lambda a: a.number)
    for attempt in attempts:
        if attempt.end_time is None:
            times = [r.get("time") for r in attempt.rows if r.get("time")]
            attempt.end_time = max(times) if times else attempt.start_time
        if attempt.end_reason is None and attempt is not attempts[-1]:
            nxt = attempts[attempts.index(attempt) + 1]
            attempt.end_reason = str(nxt.record.get("previous_end") or "crashed")
        if attempt.resumed is not None and attempt.resumed.get("step") is None:
            attempt.resumed["step"] = attempt.start_step - 1  # the checkpoint before its start
    return history


def ending(attempt: Attempt) -> str:
    """How an attempt ended, for people: the failure the history names, else its reason."""
    if attempt.failure and attempt.end_reason == "failed":
        return f"failed: {attempt.failure}"
    if attempt.failure:
        return attempt.failure
    return attempt.end_reason or "running or unknown"


def _read_config(run_dir: Path, missing: list[str]) -> dict[str, Any]:
    import yaml

    config = run_dir / "config.yaml"
    if not config.exists():
        missing.append("config.yaml absent: only the run directory is read as a checkpoint tier")
        return {}
    try:
        loaded = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, ValueError) as exc:
        missing.append(f"config.yaml unreadable ({type(exc).__name__}: {exc})")
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _tier_locations(run_dir: Path, config: dict[str, Any], missing: list[str]) -> list[Any]:
    if not config:
        return [str(run_dir)]
    try:
        from koochak.loop.checkpoint.tiers import checkpoint_locations

        train = dict(config.get("train") or {})
        train.setdefault("out_dir", str(run_dir))
        return list(checkpoint_locations(train))
    except Exception as exc:  # noqa: BLE001 - a report shows what it can
        missing.append(f"config.yaml's tiers unreadable ({type(exc).__name__}: {exc})")
        return [str(run_dir)]


def _tier_commits(
    locations: list[Any], history: list[dict[str, Any]], missing: list[str]
) -> list[TierCommits]:
    """Each tier's commits: the history's (every one, pruned since or not), then what a listing
    of the tier adds (an older run's) and which are still there."""
    from koochak.loop.checkpoint import checkpoint_store
    from koochak.loop.checkpoint.format import step_of_name

    recorded = [r for r in history if r.get("event") == "commit"]
    count = max([len(locations)] + [int(r["tier"]) + 1 for r in recorded])
    tiers = [TierCommits(i, str(getattr(loc, "location", loc))) for i, loc in enumerate(locations)]
    tiers += [TierCommits(i, "(not in config.yaml)") for i in range(len(tiers), count)]
    for record in history:
        if record.get("event") == "prune" and 0 <= int(record["tier"]) < len(tiers):
            steps = record.get("steps") or []
            found = {s for s in steps if isinstance(s, int)}
            tiers[int(record["tier"])].pruned_recorded.update(found)
    for record in recorded:
        commits = tiers[int(record["tier"])].commits
        step, when = int(record["step"]), float(record["time"])
        commits[step] = min(commits.get(step, when), when)
    for tier, location in zip(tiers, locations):
        try:
            present = {}
            # Only the location's own numbered checkpoints: superseded/<run>-<time>/ holds an
            # older run's, moved aside by a --resume none start (tier_marker), never this run's.
            for info in checkpoint_store(location).list("step"):
                if not info.key.endswith(_READY) or "/" in info.key:
                    continue
                step = step_of_name(info.key[: -len(_READY)])
                if step is not None:
                    present[step] = info.mtime_ns / 1e9
        except Exception as exc:  # noqa: BLE001 - one unreachable tier does not stop the report
            tier.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            held = "its commits are the run history's" if tier.commits else "nothing recorded"
            missing.append(f"tier {tier.index} ({tier.location}) could not be listed from here "
                           f"({tier.error}); {held}")  # fmt: skip
            continue
        if not present and tier.commits:  # an empty root: a node-local disk seen from elsewhere
            missing.append(f"tier {tier.index} ({tier.location}) lists no checkpoint from here "
                           "(another node's disk?); its commits are the run history's")  # fmt: skip
            continue
        tier.present = set(present)
        for step, when in present.items():
            tier.commits.setdefault(step, when)
        if tier.pruned:
            missing.append(f"tier {tier.index}: checkpoint(s) {', '.join(map(str, tier.pruned))} "
                           "pruned since (kept on the timeline from the run history)")  # fmt: skip
    if not recorded:
        missing.append("no commits in the run history (an older koochak): the timeline holds "
                       "only what the tiers still list, with the ready manifests' times")  # fmt: skip
    return tiers


def gather_run(run_dir: str | os.PathLike[str]) -> RunData:
    """Everything the report shows, read from ``run_dir`` (the history first, then the tiers)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ReportError(f"{root}: not a directory (give koochak-report a run's train.out_dir)")
    missing: list[str] = []
    attempts, end = _split_attempts(_read_metric_log(root, missing), missing)
    history = _apply_history(root, attempts, missing)
    if not attempts:
        raise ReportError(f"{root}: the metric log holds no rows yet")
    config = _read_config(root, missing)
    tiers = _tier_commits(_tier_locations(root, config, missing), history, missing)
    replications = [r for r in history if r.get("event") == "replicate"]
    supersedes = [r for r in history if r.get("event") == "supersede"]
    return RunData(root, attempts, tiers, end, missing, replications, config, supersedes)


# ----------------------------------------------------------------------------- drawing


def load_pyplot() -> Any:
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
    if record.get("previous_failure"):
        text += f": previous {record['previous_failure']}"
    elif previous:
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
            ax.annotate(textwrap.fill(restart_label(attempt), 70), (attempt.start_step, 0.03),
                        xycoords=("data", "axes fraction"), xytext=(4, 0),
                        textcoords="offset points", va="bottom", ha="left", fontsize=8,
                        color="#d62728", gid=f"restart-label-{attempt.number}",
                        bbox={"boxstyle": "round", "fc": "white", "ec": "#d62728",
                              "alpha": 0.85})  # fmt: skip


def build_figure(data: RunData) -> Any:
    """The report's figure (matplotlib), every artist tagged with a ``gid`` tests can find:
    ``loss-<attempt>``, ``eval_<name>-<attempt>``, ``restart-<attempt>``, ``tokens_per_s-<n>``
    / ``samples_per_s-<n>``, ``mfu-<n>``, ``commits-tier<k>``, ``lag-tier<k>``."""
    plt = load_pyplot()
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
    _timeline(ckpt_ax, data, colors)
    fig.text(0.01, 0.005, "\n".join(summary_lines(data)[:4]), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _timeline(ax: Any, data: RunData, colors: list[str]) -> None:
    """Commits per tier over the wall clock (hollow: pruned since), attempts as bands named by
    how they ended, replication lag lines, a star on each attempt's resume checkpoint."""
    attempts = data.attempts
    origin = min([a.start_time for a in attempts if a.start_time] +
                 [t for tier in data.tiers for t in tier.commits.values()] or [0.0])  # fmt: skip
    top = max(len(data.tiers), 1)
    for i, attempt in enumerate(attempts):
        if attempt.start_time and attempt.end_time:
            ax.axvspan(attempt.start_time - origin, attempt.end_time - origin,
                       color=colors[i % len(colors)], alpha=0.12,
                       gid=f"attempt-span-{attempt.number}")  # fmt: skip
            ax.annotate(textwrap.fill(f"attempt {attempt.number}: {ending(attempt)}", 90),
                        (attempt.start_time - origin, top - 0.35 - 0.18 * (i % 2)), fontsize=7,
                        va="top", gid=f"attempt-ending-{attempt.number}")  # fmt: skip
    for tier in data.tiers:
        steps = sorted(tier.commits)
        pruned = set(tier.pruned)
        kept = [s for s in steps if s not in pruned]
        color = colors[tier.index % len(colors)]
        ax.plot([tier.commits[s] - origin for s in kept], [tier.index] * len(kept), "o",
                color=color, gid=f"commits-tier{tier.index}")  # fmt: skip
        if pruned:
            ax.plot([tier.commits[s] - origin for s in sorted(pruned)], [tier.index] * len(pruned),
                    "o", markerfacecolor="white", color=color,
                    gid=f"pruned-tier{tier.index}")  # fmt: skip
        for step in steps:
            ax.annotate(str(step), (tier.commits[step] - origin, tier.index), xytext=(0, 6),
                        textcoords="offset points", fontsize=7, ha="center",
                        gid=f"commit-label-tier{tier.index}-{step}")  # fmt: skip
    _lag_lines(ax, data, origin)
    for attempt in attempts:
        resumed = attempt.resumed or {}
        tier, step = resumed.get("tier"), resumed.get("step")
        if tier is None or step is None or not 0 <= int(tier) < len(data.tiers):
            continue
        when = data.tiers[int(tier)].commits.get(int(step))
        if when is None:
            continue
        ax.plot([when - origin], [int(tier)], "*", markersize=15, color="#d62728",
                markeredgecolor="black", gid=f"resumed-from-{attempt.number}")  # fmt: skip
        ax.annotate(f"attempt {attempt.number} resumed here (tier {tier}, step {step})",
                    (when - origin, int(tier)), xytext=(6, -14), textcoords="offset points",
                    fontsize=7, color="#d62728",
                    gid=f"resumed-label-{attempt.number}")  # fmt: skip
    ax.set_yticks([t.index for t in data.tiers],
                  [_tier_tick(data, t) for t in data.tiers], fontsize=8)  # fmt: skip
    ax.set_ylim(-0.5, max(top - 0.3, 0.7))
    ax.set_xlabel("seconds since the first attempt began")
    ax.set_title("checkpoint commits per tier (hollow: pruned since; gray: replication lag; "
                 "star: resumed from)")  # fmt: skip


def _lag_lines(ax: Any, data: RunData, origin: float) -> None:
    """A gray line from each first-tier commit to its replica's commit."""
    first = data.tiers[0].commits if data.tiers else {}
    drawn: set[int] = set()
    for tier in data.tiers[1:]:
        for step in (s for s in sorted(tier.commits) if s in first):
            ax.plot([first[step] - origin, tier.commits[step] - origin], [0, tier.index],
                    color="gray", linewidth=0.8,
                    gid=f"lag-tier{tier.index}" if tier.index not in drawn else None)  # fmt: skip
            drawn.add(tier.index)


def _tier_tick(data: RunData, tier: TierCommits) -> str:
    where = tier.location if len(tier.location) <= 28 else "..." + tier.location[-25:]
    text = f"tier {tier.index}\n{where}"
    lags = data.lags(tier.index) if tier.index else []
    if lags:
        text += f"\nlag med {statistics.median(lags):.1f} s, max {max(lags):.1f} s"
    return text


def origin_line(data: RunData) -> str | None:
    """``initialised from PATH (sha256 ...)``: the weights train.init_from started the run
    from, as its (latest) start record names them; None for a run started from scratch."""
    origins = [a.origin for a in data.attempts if a.origin]
    if not origins:
        return None
    origin = origins[-1]
    ema = ", its EMA weights" if origin.get("ema") else ""
    return f"initialised from {origin['path']} (sha256 {origin.get('sha256') or '?'}{ema})"


def summary_lines(data: RunData) -> list[str]:
    lines = [line] if (line := origin_line(data)) else []
    for attempt in data.attempts:
        steps = [r["step"] for r in attempt.rows]
        span = f"steps {min(steps)}..{max(steps)}" if steps else "no logged rows"
        resumed = attempt.resumed or {}
        start = f"from step {attempt.start_step}"
        if resumed.get("step") is not None:
            start += f" (resumed from step {resumed['step']}, tier {resumed.get('tier')})"
        lines.append(f"attempt {attempt.number}: {start}, {span}, ended {ending(attempt)}")
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


def story_lines(data: RunData) -> list[str]:
    """The run's events in order, one line each: the HTML's story."""
    origin = min([a.start_time for a in data.attempts if a.start_time] or [0.0])
    events: list[tuple[float, str]] = []
    for attempt in data.attempts:
        if attempt.start_time:
            resumed = attempt.resumed or {}
            text = f"attempt {attempt.number} starts at step {attempt.start_step}"
            if resumed.get("step") is not None:
                text += f", resumed from step {resumed['step']} in tier {resumed.get('tier')}"
            for passed in resumed.get("passed_over") or []:
                text += (f"; passed over step {passed.get('step')} in tier {passed.get('tier')}: "
                         f"{passed.get('why')}")  # fmt: skip
            events.append((attempt.start_time, text))
        if attempt.end_time and attempt is not data.attempts[-1] or attempt.end_reason:
            events.append((attempt.end_time or 0.0,
                           f"attempt {attempt.number} ends: {ending(attempt)}"))  # fmt: skip
    for tier in data.tiers:
        for step, when in tier.commits.items():
            gone = " (pruned since)" if step in tier.pruned else ""
            events.append((when, f"tier {tier.index} commits step {step}{gone}"))
    for record in data.supersedes:
        steps = ", ".join(map(str, sorted(record.get("steps") or [])))
        events.append((float(record["time"]), f"attempt {record.get('attempt')} starts over "
                       f"(--resume none): run {record.get('run_id')}'s checkpoint(s) in tier "
                       f"{record.get('tier')} (step {steps or '?'}) moved aside to "
                       f"{record.get('path')}, where nothing selects or prunes them"))  # fmt: skip
    for record in data.replications:
        if record.get("status") != "committed":
            events.append((float(record["time"]), f"replication of step {record.get('step')} to "
                           f"tier {record.get('tier')} {record.get('status')}: "
                           f"{record.get('error') or ''}"))  # fmt: skip
            continue
        lag = record.get("lag_s")
        events.append((float(record["time"]), f"step {record.get('step')} replicated to tier "
                       f"{record.get('tier')}" + (f", {lag:.2f} s after the first tier's commit"
                                                  if lag is not None else "")))  # fmt: skip
    events.sort(key=lambda item: item[0])
    return [f"+{when - origin:8.2f} s  {text}" for when, text in events]


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
    load_pyplot().close(fig)
    encoded = base64.b64encode(image.getvalue()).decode("ascii")
    items = "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(data))
    gaps = "".join(f"<li>{html.escape(line)}</li>" for line in data.missing)
    story = html.escape("\n".join(story_lines(data)))
    text = (
        "<!doctype html>\n<html><head><meta charset='utf-8'>"
        f"<title>koochak run report: {html.escape(str(data.run_dir))}</title></head><body>"
        f"<h1>Run report: {html.escape(str(data.run_dir))}</h1><ul>{items}</ul>"
        f"<img alt='loss, throughput and checkpoint timeline' "
        f"src='data:image/png;base64,{encoded}'>"
        f"<h2>The story</h2><pre>{story}</pre>"
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

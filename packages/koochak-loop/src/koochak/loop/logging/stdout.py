"""Compact TSV lines on stdout (rank 0): a one-screen config summary (or, on request, the whole
resolved config) and a ``start`` line (the attempt, first update, ``max_steps``, the checkpoint
resumed from, its tier, how the previous attempt ended, the steps redone), then one line per
log/eval, and an ``end`` line with the run's goodput. The whole resolved config goes to ``<out_dir>/config.yaml``.

Lines look like ``log<TAB>step=50<TAB>loss=0.6931<TAB>lr=0.001`` so they are easy to grep, cut and
read; files (CSV, JSONL) keep the exact values.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from typing import IO, Any

import yaml
from koochak.loop.hooks import Hooks, rank0_only
from koochak.loop.logging._records import clean_metrics, format_number
from koochak.loop.logging.progress import write_line
from omegaconf import DictConfig, OmegaConf

__all__ = ["config_summary", "format_tsv", "make_stdout_hooks"]

_SUMMARY_WIDTH = 100
_ALWAYS = ("train.max_steps", "train.out_dir")  # shown even at their defaults


def format_tsv(
    event: str, step: int, metrics: Mapping[str, Any], max_steps: int | None = None
) -> str:
    """One TSV line: the event, ``step=<n>``, then ``name=value`` per metric in dict order
    (for people: ``eta_s`` as ``eta=H:MM:SS``, ``progress`` as ``progress=<done>/<max_steps>``
    when ``max_steps`` is given)."""
    fields = [event, f"step={step}"]
    for name, value in clean_metrics(metrics).items():
        if name == "eta_s" and isinstance(value, (int, float)):
            from koochak.loop.run_history import format_duration

            fields.append(f"eta={format_duration(float(value))}")
        elif name == "progress" and max_steps:
            fields.append(f"progress={step + 1}/{max_steps}")
        else:
            fields.append(f"{name}={format_number(value)}")
    return "\t".join(fields)


def _plain_config(config: Any) -> Any:
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return config


def _short(value: Any) -> str:
    if isinstance(value, str):
        return value  # paths and names in full
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def config_summary(config: Mapping[str, Any]) -> list[str]:
    """One screen of ``config``: per section, the keys whose value differs from Koochak's default
    (every key of a free-form section), plus ``train.max_steps`` and ``train.out_dir``, as
    ``section  key=value ...`` lines of at most ~100 characters."""
    from koochak.loop.config import defaults, flat_config

    base = flat_config(defaults())
    lines = []
    for section, values in config.items():
        flat = flat_config(values, str(section)) if isinstance(values, Mapping) else {}
        fields = [
            f"{key.partition('.')[2]}={_short(value)}"
            for key, value in flat.items()
            if key in _ALWAYS or base.get(key, _MISSING) != value
        ]
        line = f"{section:8}"
        for field in fields:
            if len(line) + len(field) + 1 > _SUMMARY_WIDTH and line.strip() != str(section):
                lines.append(line.rstrip())
                line = " " * 8
            line += " " + field
        if fields:
            lines.append(line.rstrip())
    return lines


_MISSING = object()


def _write_config(out_dir: str, name: str, text: str) -> str | None:
    """The whole resolved config to ``<out_dir>/<name>`` (replaced atomically); None if that
    failed (a warning: this copy is for people, the run does not depend on it).

    A read-only file there is a staged, manifest-pinned config (koochak-jobs stages it 0444 and
    the runner checks its digest at every start): it is never replaced. The resolved config then
    goes beside it as ``<stem>.resolved<suffix>`` (``config.resolved.yaml``), and nowhere when
    it equals the pinned file."""
    from koochak.loop.masking import mask_text
    from koochak.storage.fsutil import atomic_write_text

    text = mask_text(text)  # a config handed to the loop directly: named secrets, credentials
    path = os.path.join(out_dir, name)
    try:
        os.makedirs(out_dir, exist_ok=True)
        if os.path.isfile(path) and not os.stat(path).st_mode & 0o222:
            with open(path, encoding="utf-8") as handle:
                if handle.read() == text:
                    return path
            stem, suffix = os.path.splitext(name)
            path = os.path.join(out_dir, f"{stem}.resolved{suffix}")
        atomic_write_text(path, text)
    except OSError as exc:
        warnings.warn(f"could not write the resolved config to {path}: {exc}", stacklevel=3)
        return None
    return path


def make_stdout_hooks(
    stream: IO[str] | None = None,
    *,
    print_config: bool = False,
    config_file: str | None = "config.yaml",
) -> Hooks:
    """Hooks printing the config at ``on_train_start`` and TSV lines on log/eval.

    At start (rank 0) the resolved config (the loop's ``config_json``, else the ``train``
    section) is written to ``<out_dir>/<config_file>`` (None: not written), then printed: the
    whole of it with ``print_config``, else a one-screen `config_summary` naming that file.
    ``stream`` defaults to ``sys.stdout`` looked up at print time (so redirection still works).
    """

    def _print(line: str) -> None:
        # A progress bar may be drawn on the same terminal: write through it.
        write_line(line, stream if stream is not None else sys.stdout)

    limit: dict[str, Any] = {}

    def on_train_start(info: dict[str, Any]) -> None:
        limit["max_steps"] = info.get("max_steps")
        config = info.get("config_json")
        if config is None and info.get("train_cfg") is not None:
            config = {"train": info.get("train_cfg")}
        if config is not None:
            config = _plain_config(config)
            text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
            path = None
            if config_file and info.get("out_dir"):
                path = _write_config(str(info["out_dir"]), config_file, text)
            if print_config:
                _print("# resolved config\n" + text.rstrip("\n"))
            else:
                where = f"full config: {path}; " if path else ""
                _print(f"# config: what differs from the defaults ({where}logging.print_config: "
                       "true prints all of it)")  # fmt: skip
                for line in config_summary(config):
                    _print(line)
        # Where this run starts, so a resumed run (or one with nothing left to do) says so.
        fields = ["start", f"step={info.get('step', 0)}", f"max_steps={info.get('max_steps')}"]
        attempt = info.get("attempt") or {}
        if attempt:
            fields.insert(1, f"attempt={attempt['attempt']}")
        if info.get("resume_path"):
            fields.append(f"resumed_from={info['resume_path']}")
        for key in ("resumed_tier", "previous_end", "previous_step", "steps_redone"):
            if attempt.get(key) is not None:
                fields.append(f"{key}={attempt[key]}")
        _print("\t".join(fields))

    def on_log(info: dict[str, Any]) -> None:
        _print(format_tsv("log", info["step"], info["metrics"], limit.get("max_steps")))

    def on_eval_end(info: dict[str, Any]) -> None:
        _print(format_tsv("eval", info["step"], info["metrics"]))

    def on_train_end(info: dict[str, Any]) -> None:
        run = info.get("run")
        if run:  # the run's goodput so far (koochak.loop.run_history)
            fields = {k: v for k, v in run.items() if k != "note" and v is not None}
            _print(format_tsv("end", int(info.get("step", 0)), fields))

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(on_log)],
        "on_eval_end": [rank0_only(on_eval_end)],
        "on_train_end": [rank0_only(on_train_end)],
    }

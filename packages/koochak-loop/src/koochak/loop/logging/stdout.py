"""Compact TSV lines on stdout (rank 0): the resolved config and a ``start`` line (first update,
``max_steps``, the checkpoint resumed from), then one line per log/eval.

Lines look like ``log<TAB>step=50<TAB>loss=0.6931<TAB>lr=0.001`` so they are easy to grep, cut and
read; files (CSV, JSONL) keep the exact values.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import IO, Any

import yaml
from koochak.loop.hooks import Hooks, rank0_only
from koochak.loop.logging._records import clean_metrics, format_number
from koochak.loop.logging.progress import write_line
from omegaconf import DictConfig, OmegaConf

__all__ = ["format_tsv", "make_stdout_hooks"]


def format_tsv(event: str, step: int, metrics: Mapping[str, Any]) -> str:
    """One TSV line: the event, ``step=<n>``, then ``name=value`` per metric in dict order."""
    fields = [event, f"step={step}"]
    fields.extend(
        f"{name}={format_number(value)}" for name, value in clean_metrics(metrics).items()
    )
    return "\t".join(fields)


def _plain_config(config: Any) -> Any:
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    return config


def make_stdout_hooks(stream: IO[str] | None = None, *, print_config: bool = True) -> Hooks:
    """Hooks printing the resolved config at ``on_train_start`` and TSV lines on log/eval.

    ``stream`` defaults to ``sys.stdout`` looked up at print time (so redirection still works).
    """

    def _print(line: str) -> None:
        # A progress bar may be drawn on the same terminal: write through it.
        write_line(line, stream if stream is not None else sys.stdout)

    def on_train_start(info: dict[str, Any]) -> None:
        if print_config:
            config = info.get("config_json")
            if config is None:
                config = {"train": info.get("train_cfg")}
            text = yaml.safe_dump(_plain_config(config), sort_keys=False, default_flow_style=False)
            _print("# resolved config\n" + text.rstrip("\n"))
        # Where this run starts, so a resumed run (or one with nothing left to do) says so.
        fields = ["start", f"step={info.get('step', 0)}", f"max_steps={info.get('max_steps')}"]
        if info.get("resume_path"):
            fields.append(f"resumed_from={info['resume_path']}")
        _print("\t".join(fields))

    def on_log(info: dict[str, Any]) -> None:
        _print(format_tsv("log", info["step"], info["metrics"]))

    def on_eval_end(info: dict[str, Any]) -> None:
        _print(format_tsv("eval", info["step"], info["metrics"]))

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(on_log)],
        "on_eval_end": [rank0_only(on_eval_end)],
    }

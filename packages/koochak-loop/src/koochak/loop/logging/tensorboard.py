"""TensorBoard hooks (rank 0): the resolved config as text at start, then every logged scalar.

For clusters without W&B. Event files go to ``log_dir`` (the CLI's default is
``<train.out_dir>/tensorboard``); point ``tensorboard --logdir`` at it. The writer is torch's
``SummaryWriter``, which needs the ``tensorboard`` package: it is imported when the hooks are
built (so a missing package fails the launch, naming the extra), never at module import; the
writer itself is created on rank 0 at the first event.
"""

from __future__ import annotations

import os
from typing import Any

import yaml
from koochak.loop.hooks import Hooks, rank0_only
from omegaconf import DictConfig, OmegaConf

__all__ = ["config_text", "make_tensorboard_hooks"]


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "the TensorBoard sink needs the tensorboard package; install the extra: "
            "pip install 'koochak-loop[tensorboard]'"
        ) from None
    return SummaryWriter


def config_text(config: Any) -> str:
    """The resolved config as YAML inside a Markdown code block (TensorBoard renders Markdown)."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    # Four leading spaces make a Markdown code block, so indentation survives the rendering.
    return "\n".join("    " + line for line in body.rstrip("\n").splitlines())


def make_tensorboard_hooks(log_dir: str | os.PathLike[str], *, flush_secs: int = 30) -> Hooks:
    """Rank-0 hooks writing TensorBoard event files under ``log_dir``.

    ``on_train_start`` records the resolved config (``info["config_json"]``, else the ``train``
    section) as the text ``config`` and the attempt record as the text ``attempt`` (and the
    scalar ``attempt``); ``on_train_end`` the goodput (text ``end``, scalars ``goodput``,
    ``goodput_steps_per_s``); ``on_log`` and ``on_eval_end`` add one scalar per numeric
    metric at the update's step (strings are skipped); the writer is flushed and closed at
    ``on_train_end`` and ``on_exception``. Nothing is created on other ranks.
    """
    log_dir = os.fspath(log_dir)
    summary_writer = _summary_writer()
    state: dict[str, Any] = {"writer": None}

    def writer() -> Any:
        if state["writer"] is None:
            state["writer"] = summary_writer(log_dir=log_dir, flush_secs=flush_secs)
        return state["writer"]

    def on_train_start(info: dict[str, Any]) -> None:
        config = info.get("config_json")
        if config is None:
            config = {"train": info.get("train_cfg")}
        step = int(info.get("step", 0))
        writer().add_text("config", config_text(config), global_step=step)
        attempt = info.get("attempt")
        if attempt:  # the attempt record: its note as text, its number as a scalar
            writer().add_text("attempt", str(attempt.get("note", "")), global_step=step)
            writer().add_scalar("attempt", float(attempt["attempt"]), global_step=step)

    def on_metrics(info: dict[str, Any]) -> None:
        out, step = writer(), int(info["step"])
        for name, value in info["metrics"].items():
            if hasattr(value, "item") and callable(value.item):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out.add_scalar(name, float(value), global_step=step)

    def on_train_end(info: dict[str, Any]) -> None:
        run = info.get("run")
        if run:
            step = int(info.get("step", 0))
            writer().add_text("end", str(run.get("note", "")), global_step=step)
            for name in ("goodput", "goodput_steps_per_s"):
                if run.get(name) is not None:
                    writer().add_scalar(name, float(run[name]), global_step=step)
        close(info)

    def close(info: dict[str, Any]) -> None:
        if state["writer"] is not None:
            state["writer"].close()
            state["writer"] = None

    return {
        "on_train_start": [rank0_only(on_train_start)],
        "on_log": [rank0_only(on_metrics)],
        "on_eval_end": [rank0_only(on_metrics)],
        "on_train_end": [rank0_only(on_train_end)],
        "on_exception": [rank0_only(close)],
    }

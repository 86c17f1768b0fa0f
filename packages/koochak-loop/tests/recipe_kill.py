"""``entry.hooks`` for test_recipes.py: with RECIPE_KILL_AT=N, rank 0 SIGKILLs its own process
at the end of update N (before that update's periodic save); with RECIPE_START_DUMP=DIR, every
rank writes the weights it starts from (``on_train_start``: after ``train.init_from``, before DDP
broadcasts anything; gathered from the shards under FSDP) to ``DIR/start-<rank>.pt``."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch


def hooks(cfg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    at = os.environ.get("RECIPE_KILL_AT")
    if at is not None:

        def on_step_end(info: dict[str, Any]) -> None:
            if info["step"] == int(at) and int(os.environ.get("RANK", "0")) == 0:
                os.kill(os.getpid(), signal.SIGKILL)

        out["on_step_end"] = [on_step_end]
    dump = os.environ.get("RECIPE_START_DUMP")
    if dump is not None:

        def on_train_start(info: dict[str, Any]) -> None:
            weights = {}
            for name, value in info["model"].state_dict().items():
                full = getattr(value, "full_tensor", None)  # a DTensor shard: every rank gathers
                weights[name] = (full() if full is not None else value).detach().clone()
            torch.save(weights, os.path.join(dump, f"start-{info['rank']}.pt"))

        out["on_train_start"] = [on_train_start]
    return out

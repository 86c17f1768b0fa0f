"""``entry.hooks`` for test_recipes.py: with RECIPE_KILL_AT=N, rank 0 SIGKILLs its own process
at the end of update N (before that update's periodic save); without it, no hooks."""

from __future__ import annotations

import os
import signal
from typing import Any


def hooks(cfg: Any) -> dict[str, Any]:
    at = os.environ.get("RECIPE_KILL_AT")
    if at is None:
        return {}

    def on_step_end(info: dict[str, Any]) -> None:
        if info["step"] == int(at) and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    return {"on_step_end": [on_step_end]}

"""koochak.loop: a tiny, hackable, function-first PyTorch training loop.

``from koochak.loop import training_loop`` is the entry point; config, hooks and precision
helpers are re-exported here, everything else lives in its own small module.
"""

from koochak.loop.config import ConfigError, get_section, load_config, to_container
from koochak.loop.hooks import add, emit, fail_closed, merge, rank0_only
from koochak.loop.loop import StepContext, training_loop
from koochak.loop.precision import Scaler, autocast_context

__all__ = [
    "ConfigError",
    "Scaler",
    "StepContext",
    "add",
    "autocast_context",
    "emit",
    "fail_closed",
    "get_section",
    "load_config",
    "merge",
    "rank0_only",
    "to_container",
    "training_loop",
]

"""koochak.loop: a tiny, hackable, function-first PyTorch training loop.

``from koochak.loop import training_loop`` is the entry point; config, hooks and precision
helpers are re-exported here, everything else lives in its own small module.

The re-exports are resolved on first use (PEP 562), so importing a submodule that needs no
torch — ``python -m koochak.loop.launch`` above all — does not pay for torch first: the
launcher takes an evacuation signal from its first instant, not only after torch imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from koochak.storage.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from koochak.loop.config import ConfigError, get_section, load_config, to_container
    from koochak.loop.hooks import add, emit, fail_closed, merge, rank0_only
    from koochak.loop.loop import training_loop
    from koochak.loop.precision import Scaler, autocast_context
    from koochak.loop.update import StepContext, micro_step, standard_update

_HOME = {
    "ConfigError": "koochak.loop.config",
    "get_section": "koochak.loop.config",
    "load_config": "koochak.loop.config",
    "to_container": "koochak.loop.config",
    "add": "koochak.loop.hooks",
    "emit": "koochak.loop.hooks",
    "fail_closed": "koochak.loop.hooks",
    "merge": "koochak.loop.hooks",
    "rank0_only": "koochak.loop.hooks",
    "StepContext": "koochak.loop.update",
    "micro_step": "koochak.loop.update",
    "standard_update": "koochak.loop.update",
    "training_loop": "koochak.loop.loop",
    "Scaler": "koochak.loop.precision",
    "autocast_context": "koochak.loop.precision",
}

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
    "micro_step",
    "rank0_only",
    "standard_update",
    "to_container",
    "training_loop",
]
assert sorted(__all__) == sorted(_HOME)


__getattr__, __dir__ = lazy_exports(__name__, _HOME, globals())

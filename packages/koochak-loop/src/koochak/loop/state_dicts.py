"""State-dict plumbing shared by checkpoints and EMA shadows: the module whose weights are stored
(no DDP or torch.compile wrapper) and the ``module.`` prefix rule that makes a state dict load into
either kind of model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["match_state_dict_to_model", "unwrap_model"]


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose weights a checkpoint stores: without DDP or torch.compile wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def match_state_dict_to_model(
    model: torch.nn.Module, state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """Add or strip the ``module.`` prefix so ``state_dict`` keys match ``model``'s own keys.

    Checkpoints store unwrapped weights, but a state dict taken from a DDP-wrapped model by hand
    carries ``module.``; this makes either kind load into either kind of model.
    """
    model_keys = list(model.state_dict().keys())
    sd_keys = list(state_dict.keys())
    prefix = "module."
    model_prefixed = bool(model_keys) and all(k.startswith(prefix) for k in model_keys)
    sd_prefixed = bool(sd_keys) and all(k.startswith(prefix) for k in sd_keys)
    if model_prefixed and not sd_prefixed:
        return {prefix + k: v for k, v in state_dict.items()}
    if sd_prefixed and not model_prefixed:
        return {k[len(prefix) :]: v for k, v in state_dict.items()}
    return dict(state_dict)

"""``train.init_from``: start a fresh run from another run's weights (a fine-tune).

The source is an export (``model.pt``: a bare state dict, or ``*.safetensors``), a checkpoint
file (``step*.pt``, one file or a parts index), or a checkpoint location (a directory or URI:
its highest valid published checkpoint). Only the weights are taken (``train.init_from_ema``: the
first EMA shadow's, from a checkpoint); the optimizer, schedule, step and data cursor start
fresh. The origin ``{"path", "sha256", "ema"}`` goes into every checkpoint of the run (field
``origin``) and into its attempt record, so a model's lineage can be traced to the bytes it
started from. A resumed run does not load them again: its checkpoint already holds the weights.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model


def load_init_weights(
    source: str, *, ema: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state dict, origin)`` for ``train.init_from``; ValueError naming the source when it
    holds no usable weights."""
    where = f"train.init_from={source!r}"
    local = source[len("file://") :] if source.startswith("file://") else source
    if "://" not in local and os.path.isfile(local):
        if local.endswith(".safetensors"):
            return _safetensors(local, where, ema)
        try:
            payload = torch.load(local, map_location="cpu", weights_only=True)
        except Exception:  # a checkpoint written in parts: its index is no torch file
            payload = None
        digest = _sha256_file(local)
        if payload is None or (
            isinstance(payload, Mapping) and "version" in payload and "next_step" in payload
        ):
            from koochak.loop.checkpoint.resume import load

            return _weights(load(local), where, ema), _origin(local, digest, ema)
        if ema:
            raise ValueError(f"{where}: an export holds one set of weights; "
                             "train.init_from_ema needs a checkpoint with EMA shadows")  # fmt: skip
        if not isinstance(payload, Mapping) or not all(
            isinstance(v, torch.Tensor) for v in payload.values()
        ):
            raise ValueError(f"{where}: neither a checkpoint nor an exported state dict")
        return {str(k): v for k, v in payload.items()}, _origin(local, digest, ema)
    if "://" not in local and not os.path.isdir(local):
        raise ValueError(f"{where}: no such file or directory")
    from koochak.loop.checkpoint.commit import publication_path
    from koochak.loop.checkpoint.publication import checkpoint_store
    from koochak.loop.checkpoint.resume import highest_valid

    found = highest_valid([checkpoint_store(source)])
    if found is None:
        raise ValueError(f"{where}: no valid published checkpoint there")
    path = publication_path(found.store, found.publication)
    weights = _weights(found.checkpoint, f"{where} ({path})", ema)
    return weights, _origin(path, found.publication.sha256, ema)


def apply_init_weights(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], source: str
) -> None:
    """Load ``weights`` into ``model`` (before it is sharded); every name and shape must match:
    a mismatch is refused naming the parameter, both shapes and the source."""
    target = unwrap_model(model)
    state = match_state_dict_to_model(target, dict(weights))
    live = target.state_dict()
    missing, extra = sorted(live.keys() - state.keys()), sorted(state.keys() - live.keys())
    if missing or extra:
        raise ValueError(f"train.init_from={source!r}: the weights do not fit the model: "
                         f"missing {missing[:5]}, unexpected {extra[:5]}")  # fmt: skip
    for name, value in state.items():
        if tuple(value.shape) != tuple(live[name].shape):
            raise ValueError(f"train.init_from={source!r}: {name} has shape {tuple(value.shape)} "
                             f"there but {tuple(live[name].shape)} in this model")  # fmt: skip
    target.load_state_dict(state)


def _weights(ckpt: Mapping[str, Any], where: str, ema: bool) -> dict[str, torch.Tensor]:
    if not ema:
        state = ckpt["model"]
    else:
        shadows = (ckpt.get("ema") or {}).get("shadows") or []
        if not shadows:
            raise ValueError(f"{where}: train.init_from_ema, but the checkpoint has no EMA shadow")
        state = shadows[0]["state_dict"]
    return {str(k): v for k, v in state.items()}


def _safetensors(path: str, where: str, ema: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    if ema:
        raise ValueError(f"{where}: an export holds one set of weights; "
                         "train.init_from_ema needs a checkpoint with EMA shadows")  # fmt: skip
    from koochak.loop.checkpoint.safetensors_out import require_safetensors

    require_safetensors()
    from safetensors.torch import load_file

    return dict(load_file(path)), _origin(path, _sha256_file(path), ema)


def _origin(path: str, sha256: str, ema: bool) -> dict[str, Any]:
    return {"path": str(path), "sha256": str(sha256), "ema": bool(ema)}


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

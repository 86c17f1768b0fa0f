"""The checkpoint dict: its fields, its names, and the checks every reader applies.

A checkpoint is a plain dict of named parts (documented in docs/formats.md, "Checkpoint dict"):
``build_checkpoint`` assembles it from live objects, ``check_checkpoint_format`` refuses anything
else (an unknown version or field, a field of the wrong type) naming the file and the field, and
``check_resume_cursor`` ties ``step``/``next_step`` to the numbered name ``step{N:09d}.pt``.
Turning the dict into bytes and back is ``serialization``'s job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from koochak.loop.elastic import check_elastic_state
from koochak.loop.ema import check_ema_state
from koochak.loop.seed import check_rng_state
from koochak.loop.state_dicts import unwrap_model
from koochak.loop.user_state import check_user_state

CHECKPOINT_VERSION = 1
# Numbered checkpoint names; group 1 is the number used for ordering and cursor checks.
CHECKPOINT_PATTERN = r"step(\d{9})\.pt"
LATEST_NAME = "latest.pt"

# Why a checkpoint was written. Periodic ones resume at step + 1, the others at step.
REASONS = ("periodic", "terminal", "evacuation", "gpu_health", "stopped")

_REQUIRED_KEYS = frozenset({"version", "step", "next_step", "model"})
_KNOWN_KEYS = _REQUIRED_KEYS | frozenset(
    {
        "reason",
        "optimizer",
        "scheduler",
        "scaler",
        "ema",
        "config",
        "rng",
        "rng_per_rank",
        "world_size",
        "wall_time",
        "metrics",
        "data",
        "run_id",
        "user_state",
        "origin",
    }
)


def checkpoint_name(step: int) -> str:
    """The file name of the numbered checkpoint for ``step``: ``step{N:09d}.pt``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"step{step:09d}.pt"


def step_of_name(name: str) -> int | None:
    """The number in a numbered checkpoint name (last path segment), or None for other names."""
    match = re.fullmatch(CHECKPOINT_PATTERN, name.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def build_checkpoint(
    *,
    step: int,
    next_step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    config: Mapping[str, Any] | None = None,
    rng: Mapping[str, Any] | None = None,
    rng_per_rank: list[Any] | None = None,
    world_size: int = 1,
    wall_time: float | None = None,
    metrics: Mapping[str, Any] | None = None,
    ema: Mapping[str, Any] | None = None,
    reason: str = "periodic",
    data: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    user_state: Mapping[str, Any] | None = None,
    origin: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble a checkpoint dict.

    ``step``/``next_step`` are the resume cursor: a periodic checkpoint keeps the zero-based index of
    the update it follows and resumes at ``step + 1``; terminal, evacuation and GPU-health
    checkpoints record the number of completed updates and resume at that same number.
    The tensors are the live ones (``state_dict`` shares storage); serialize at once if the values
    must be frozen. ``data`` is the elastic data cursor (``ElasticBatches.state_after``); the
    field is left out when None, so checkpoints of runs without one read as before; so is
    ``run_id`` (the run's stable id, ``train.run_id``; docs/formats.md, "Tier marker"), and so
    are ``user_state`` (`koochak.loop.user_state.capture_state`) and ``origin`` (where
    ``train.init_from`` took the weights from: ``{"path", "sha256", "ema"}``).
    """
    if reason not in REASONS:
        raise ValueError(f"checkpoint reason must be one of {REASONS}, got {reason!r}")
    expected_next = step + 1 if reason == "periodic" else step
    if next_step != expected_next:
        raise ValueError(
            f"a {reason} checkpoint at step {step} must have next_step={expected_next}, "
            f"got {next_step}"
        )
    ckpt = {
        "version": CHECKPOINT_VERSION,
        "step": int(step),
        "next_step": int(next_step),
        "reason": reason,
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": _state_dict_or_none(scheduler),
        "scaler": _scaler_state(scaler),
        "ema": dict(ema) if ema is not None else None,
        "config": _plain(config) if config is not None else None,
        "rng": dict(rng) if rng is not None else None,
        "rng_per_rank": list(rng_per_rank) if rng_per_rank is not None else None,
        "world_size": int(world_size),
        "wall_time": float(wall_time) if wall_time is not None else None,
        "metrics": {str(k): _scalar(v) for k, v in (metrics or {}).items()},
    }
    if data is not None:
        ckpt["data"] = dict(data)
    if run_id is not None:
        ckpt["run_id"] = str(run_id)
    if user_state is not None:
        ckpt["user_state"] = dict(user_state)
    if origin is not None:
        ckpt["origin"] = dict(origin)
    return ckpt


def check_rng_fields(ckpt: Mapping[str, Any], source: str) -> None:
    """Raise ValueError naming ``source`` unless ``rng``/``rng_per_rank`` hold states the loop's
    resume can restore (`koochak.loop.seed.check_rng_state`). Resume candidates must pass it:
    a state that fails to restore after the weights are loaded would stop the run instead of
    skipping the candidate."""
    if ckpt.get("rng") is not None:
        check_rng_state(ckpt["rng"], f"{source}: field 'rng'")
    per_rank = ckpt.get("rng_per_rank")
    if per_rank is not None:
        for rank, state in enumerate(per_rank):
            if state is not None:
                check_rng_state(state, f"{source}: field 'rng_per_rank'[{rank}]")


# Optional fields that hold a mapping (a state dict, the config, ...) or null.


_MAPPING_OR_NULL = ("optimizer", "scheduler", "scaler", "ema", "config", "rng", "metrics", "data")


def check_checkpoint_format(ckpt: Any, source: str) -> None:
    """Raise ValueError naming ``source`` and the field unless ``ckpt`` is a version-1 checkpoint.

    Checked: required and known fields, an exact-int version, the cursor's types, the reason,
    and the type of every other field (``model`` a mapping with string keys, the state dicts
    mappings or null, ``metrics`` a mapping of scalars, ``rng_per_rank`` a list, ...).
    """
    if not isinstance(ckpt, Mapping):
        raise ValueError(f"{source}: a checkpoint must be a dict, got {type(ckpt).__name__}")
    missing = sorted(_REQUIRED_KEYS - ckpt.keys())
    if missing:
        raise ValueError(f"{source}: checkpoint is missing field(s) {missing}")
    version = ckpt["version"]
    if type(version) is not int or version != CHECKPOINT_VERSION:  # not True, 1.0 or a tensor
        raise ValueError(
            f"{source}: field 'version' is {_short(version)}; this Koochak reads version "
            f"{CHECKPOINT_VERSION}"
        )
    unknown = sorted(str(k) for k in ckpt.keys() - _KNOWN_KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown checkpoint field(s) {unknown}")
    for key in ("step", "next_step"):
        value = ckpt[key]
        if type(value) is not int or value < 0:
            raise ValueError(
                f"{source}: field '{key}' must be a non-negative int, got {_short(value)}"
            )
    reason = ckpt.get("reason", "periodic")
    if not isinstance(reason, str) or reason not in REASONS:
        raise ValueError(f"{source}: field 'reason' must be one of {REASONS}, got {_short(reason)}")
    model = ckpt["model"]
    if not isinstance(model, Mapping) or not all(isinstance(k, str) for k in model):
        raise ValueError(
            f"{source}: field 'model' must be a state dict (a mapping with string keys), "
            f"got {_short(model)}"
        )
    for key in _MAPPING_OR_NULL:
        value = ckpt.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(
                f"{source}: field '{key}' must be a mapping or null, got {_short(value)}"
            )
    optimizer = ckpt.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer.get("state"), Mapping)
        and isinstance(optimizer.get("param_groups"), list)
        and all(isinstance(group, Mapping) for group in optimizer["param_groups"])
    ):
        raise ValueError(
            f"{source}: field 'optimizer' must be an optimizer state dict "
            "(a 'state' mapping and a 'param_groups' list of mappings)"
        )
    for name, value in (ckpt.get("metrics") or {}).items():
        if not isinstance(value, (bool, int, float, str)) and value is not None:
            raise ValueError(
                f"{source}: field 'metrics'[{name!r}] must be a scalar, got {_short(value)}"
            )
    per_rank = ckpt.get("rng_per_rank")
    if per_rank is not None and not isinstance(per_rank, list):
        raise ValueError(
            f"{source}: field 'rng_per_rank' must be a list or null, got {_short(per_rank)}"
        )
    world_size = ckpt.get("world_size", 1)
    if type(world_size) is not int or world_size < 1:
        raise ValueError(
            f"{source}: field 'world_size' must be an int >= 1, got {_short(world_size)}"
        )
    wall_time = ckpt.get("wall_time")
    if wall_time is not None and (type(wall_time) not in (int, float)):
        raise ValueError(
            f"{source}: field 'wall_time' must be a number or null, got {_short(wall_time)}"
        )
    if ckpt.get("ema") is not None:
        check_ema_state(ckpt["ema"], source)
    if ckpt.get("data") is not None:
        check_elastic_state(ckpt["data"], source)
    if "user_state" in ckpt:
        check_user_state(ckpt["user_state"], source)
    if "origin" in ckpt:
        check_origin(ckpt["origin"], source)


def check_origin(origin: Any, source: str) -> None:
    """The ``origin`` field: ``{"path": str, "sha256": str, "ema": bool}`` and nothing else."""
    if not isinstance(origin, Mapping) or set(origin) != {"path", "sha256", "ema"}:
        raise ValueError(f"{source}: field 'origin' must be a mapping with exactly the keys "
                         f"['ema', 'path', 'sha256'], got {_short(origin)}"
                         + (f" with keys {sorted(map(str, origin))}" if isinstance(origin, Mapping)
                            else ""))  # fmt: skip
    if not isinstance(origin["path"], str) or not isinstance(origin["sha256"], str):
        raise ValueError(f"{source}: field 'origin': 'path' and 'sha256' must be strings")
    if not isinstance(origin["ema"], bool):
        raise ValueError(f"{source}: field 'origin': 'ema' must be true or false")


def _short(value: Any) -> str:
    """A value for an error message: tensors and containers by type, short reprs as is."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else ""
    return text if text and len(text) <= 80 else f"a {type(value).__name__}"


def check_resume_cursor(ckpt: Mapping[str, Any], name: str) -> None:
    """Raise ValueError unless the cursor agrees with the file name and the checkpoint's reason.

    The number in ``step{N:09d}.pt`` must equal ``step``; ``next_step`` must be ``step + 1`` for a
    periodic checkpoint and ``step`` for every terminal kind.
    """
    number = step_of_name(name)
    if number is None:
        raise ValueError(f"{name}: not a numbered checkpoint name (step{{N:09d}}.pt)")
    step, next_step = ckpt["step"], ckpt["next_step"]
    if step != number:
        raise ValueError(f"{name}: field 'step' is {step} but the file name says {number}")
    reason = ckpt.get("reason", "periodic")
    expected = step + 1 if reason == "periodic" else step
    if next_step != expected:
        raise ValueError(
            f"{name}: field 'next_step' is {next_step}; a {reason} checkpoint at step {step} "
            f"resumes at {expected}"
        )


def _state_dict_or_none(obj: Any) -> Any:
    return obj.state_dict() if obj is not None and hasattr(obj, "state_dict") else None


def _scaler_state(scaler: Any) -> Any:
    if scaler is None or not hasattr(scaler, "state_dict"):
        return None
    if hasattr(scaler, "is_enabled") and not scaler.is_enabled():
        return None
    return scaler.state_dict()


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().item()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint metric value must be a scalar, got {value!r}") from exc


def _plain(value: Any) -> Any:
    """Config as plain containers (weights-only loadable); OmegaConf nodes are resolved first."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)

# NumPy arrays (in RNG states) as tagged tuples of bytes, so a weights-only load accepts them.
NDARRAY_TAG = "__koochak_ndarray__"


def tag_ndarrays(value: Any) -> Any:
    """``value`` with every NumPy array a tagged tuple ``(NDARRAY_TAG, dtype, shape, bytes)``."""
    return walk_tree(value, _tag_ndarray)


def untag_ndarrays(value: Any) -> Any:
    """``tag_ndarrays`` undone; a malformed array record is a ValueError naming what is wrong."""
    return walk_tree(value, _untag_ndarray)


def walk_tree(value: Any, leaf: Any) -> Any:
    """Rebuild dicts, lists and tuples, replacing whatever ``leaf`` turns into something else."""
    replaced = leaf(value)
    if replaced is not value:
        return replaced
    if isinstance(value, Mapping):
        return {k: walk_tree(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [walk_tree(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(walk_tree(v, leaf) for v in value)
    return value


def _tag_ndarray(value: Any) -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return value
    if isinstance(value, np.ndarray):
        return (NDARRAY_TAG, value.dtype.str, list(value.shape), value.tobytes())
    return value


def _untag_ndarray(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == NDARRAY_TAG:
        import numpy as np

        _, dtype, shape, raw = value
        if not isinstance(dtype, str) or not isinstance(raw, bytes):
            raise ValueError(f"array record: dtype must be a str and data bytes, got {dtype!r}")
        if not isinstance(shape, (list, tuple)) or not all(
            type(n) is int and n >= 0 for n in shape
        ):
            raise ValueError(f"array record: shape must be non-negative ints, got {shape!r}")
        try:
            kind = np.dtype(dtype)
        except TypeError as exc:
            raise ValueError(f"array record: dtype {dtype!r} is not a NumPy dtype") from exc
        if kind.hasobject:  # would need unpickling; an RNG state never holds objects
            raise ValueError(f"array record: dtype {dtype!r} holds Python objects")
        return np.frombuffer(raw, dtype=kind).reshape(shape).copy()
    return value

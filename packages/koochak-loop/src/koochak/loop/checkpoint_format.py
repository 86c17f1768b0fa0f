"""The checkpoint dict: its fields, its bytes, and putting it back into a model.

A checkpoint is a plain dict of named parts (documented in docs/formats.md, "Checkpoint dict").
It is serialized with ``torch.save`` into memory and read back with
``torch.load(weights_only=True)``, so loading an untrusted checkpoint cannot run code: the payload
holds only tensors, containers and primitive values. Anything that is not (NumPy arrays inside RNG
states) is encoded into that vocabulary here and decoded on the way back.
"""

from __future__ import annotations

import io
import queue
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from koochak.loop.ema import ModelEma, check_ema_state, restore_ema
from koochak.loop.state_dicts import match_state_dict_to_model, unwrap_model

CHECKPOINT_VERSION = 1
# Numbered checkpoint names; group 1 is the number used for ordering and cursor checks.
CHECKPOINT_PATTERN = r"step(\d{9})\.pt"
LATEST_NAME = "latest.pt"

# Why a checkpoint was written. Periodic ones resume at step + 1, the others at step.
REASONS = ("periodic", "terminal", "evacuation", "gpu_health")

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
    }
)

_NDARRAY_TAG = "__koochak_ndarray__"


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
) -> dict[str, Any]:
    """Assemble a checkpoint dict.

    ``step``/``next_step`` are the resume cursor: a periodic checkpoint keeps the zero-based index of
    the update it follows and resumes at ``step + 1``; terminal, evacuation and GPU-health
    checkpoints record the number of completed updates and resume at that same number.
    The tensors are the live ones (``state_dict`` shares storage); serialize at once if the values
    must be frozen.
    """
    if reason not in REASONS:
        raise ValueError(f"checkpoint reason must be one of {REASONS}, got {reason!r}")
    expected_next = step + 1 if reason == "periodic" else step
    if next_step != expected_next:
        raise ValueError(
            f"a {reason} checkpoint at step {step} must have next_step={expected_next}, "
            f"got {next_step}"
        )
    return {
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


def serialize_checkpoint(ckpt: Mapping[str, Any]) -> bytes:
    """The checkpoint as ``torch.save`` bytes, with RNG states encoded for weights-only loading."""
    return bytes(serialize_checkpoint_buffer(ckpt))


def serialize_checkpoint_buffer(ckpt: Mapping[str, Any]) -> memoryview:
    """Like ``serialize_checkpoint`` without the final copy: a view of the serialized buffer."""
    buffer = io.BytesIO()
    with _no_zip_crc():
        torch.save(_payload(ckpt), buffer)
    return buffer.getbuffer()


def _no_zip_crc() -> Any:
    # Every published byte is covered by the manifest's SHA256, checked on every resume read;
    # the zip container's own CRC32 would cost about a third of serialization time on top.
    # torch.load reads files without it. (The switch is process-wide while a save runs.)
    from torch.utils.serialization import config

    return config.patch({"save.compute_crc32": False})


def serialize_checkpoint_chunks(ckpt: Mapping[str, Any]) -> Iterator[bytes | memoryview]:
    """The same bytes as ``serialize_checkpoint``, streamed while ``torch.save`` produces them.

    ``torch.save`` runs on a helper thread; large writes (tensor storages) are handed over as
    views without copying, and the helper waits until the consumer asks for the next chunk, which
    a Store does only once it has written and hashed the previous one. Small writes (headers,
    the pickle) are batched into copies. So the payload is never held whole in memory and tensor
    bytes are never copied on the way to the store. Each chunk is valid only until the next one is
    requested (copy it to keep it). Use it only while nothing mutates the tensors (a synchronous
    save); stopping early (a failed write) cancels the serialization.
    """
    payload = _payload(ckpt)  # format errors surface here, on the caller's thread
    return _stream(payload)


# Writes at least this large go over as views; smaller ones are copied into batches this large.
_ZERO_COPY_BYTES = 1 << 20


def _stream(payload: dict[str, Any]) -> Iterator[bytes | memoryview]:
    handoff: queue.Queue[Any] = queue.Queue()
    done = object()
    state: dict[str, Any] = {"error": None, "cancel": False}

    class _Writer:
        def __init__(self) -> None:
            self.pending = bytearray()

        def write(self, data: Any) -> int:
            if state["cancel"]:
                raise _SerializationCancelled
            view = memoryview(data).cast("B")
            if view.nbytes < _ZERO_COPY_BYTES:
                self.pending += view
                if len(self.pending) >= _ZERO_COPY_BYTES:
                    self.flush()
                return view.nbytes
            self.flush()
            consumed = threading.Event()
            handoff.put((view, consumed))
            consumed.wait()  # torch may free or reuse the buffer once write() returns
            if state["cancel"]:
                raise _SerializationCancelled
            return view.nbytes

        def flush(self) -> None:
            if self.pending:
                handoff.put((bytes(self.pending), None))
                self.pending.clear()

    def produce() -> None:
        try:
            writer = _Writer()
            with _no_zip_crc():
                torch.save(payload, writer)
            writer.flush()
        except _SerializationCancelled:
            pass
        except BaseException as exc:  # re-raised on the consuming thread
            state["error"] = exc
        finally:
            handoff.put(done)

    thread = threading.Thread(target=produce, name="koochak-serialize", daemon=True)
    thread.start()
    finished = False
    try:
        while True:
            item = handoff.get()
            if item is done:
                finished = True
                break
            chunk, consumed = item
            try:
                yield chunk
            finally:  # resumed (or closed): the consumer is done with this chunk
                if consumed is not None:
                    consumed.set()
    finally:
        if not finished:  # the consumer stopped early: release and stop the producer
            state["cancel"] = True
            while True:
                item = handoff.get()
                if item is done:
                    break
                if item[1] is not None:
                    item[1].set()
        thread.join()
    if state["error"] is not None:
        raise state["error"]


class _SerializationCancelled(Exception):
    pass


def _payload(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    check_checkpoint_format(ckpt, "checkpoint to save")
    payload = dict(ckpt)
    for key in ("rng", "rng_per_rank"):
        if payload.get(key) is not None:
            payload[key] = _encode(payload[key])
    return payload


def deserialize_checkpoint(data: bytes | bytearray | memoryview, source: str) -> dict[str, Any]:
    """Load checkpoint bytes onto the CPU with ``weights_only=True`` and check the format.

    ``source`` names the file in errors. Every way the payload can fail to decode is a
    ValueError naming ``source``: bytes torch cannot load, a payload that needs arbitrary
    unpickling (a code object, a class), a dict of an unknown version or with unknown keys, a
    field of the wrong type, an array record that does not decode. (Resume relies on this: a
    candidate that raises ValueError is skipped, never a crash.)
    """
    try:
        ckpt = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    except (MemoryError, OSError):
        raise
    except Exception as exc:  # torch raises many types for hostile bytes; all mean "not loadable"
        raise ValueError(
            f"{source}: not a loadable weights-only checkpoint ({_first_line(exc)})"
        ) from exc
    check_checkpoint_format(ckpt, source)
    for key in ("rng", "rng_per_rank"):
        if ckpt.get(key) is not None:
            try:
                ckpt[key] = _decode(ckpt[key])
            except (MemoryError, RecursionError):
                raise
            except Exception as exc:
                raise ValueError(
                    f"{source}: field {key!r} does not decode ({_first_line(exc)})"
                ) from exc
    return ckpt


def _first_line(exc: BaseException) -> str:
    # torch's messages carry terminal escapes (bold); a log line should not.
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_rng_fields(ckpt: Mapping[str, Any], source: str) -> None:
    """Raise ValueError naming ``source`` unless ``rng``/``rng_per_rank`` hold states the loop's
    resume can restore (`koochak.loop.seed.check_rng_state`). Resume candidates must pass it:
    a state that fails to restore after the weights are loaded would stop the run instead of
    skipping the candidate."""
    from koochak.loop.seed import check_rng_state

    if ckpt.get("rng") is not None:
        check_rng_state(ckpt["rng"], f"{source}: field 'rng'")
    per_rank = ckpt.get("rng_per_rank")
    if per_rank is not None:
        for rank, state in enumerate(per_rank):
            if state is not None:
                check_rng_state(state, f"{source}: field 'rng_per_rank'[{rank}]")


# Optional fields that hold a mapping (a state dict, the config, ...) or null.
_MAPPING_OR_NULL = ("optimizer", "scheduler", "scaler", "ema", "config", "rng", "metrics")


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


def restore_training_state(
    ckpt: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    ema: ModelEma | None = None,
) -> int:
    """Load weights, optimizer, scheduler, scaler and EMA state from ``ckpt``; return ``next_step``.

    The model may be wrapped (DDP, compile) or not; the optimizer moves its state onto the
    parameters' devices itself. RNG is restored separately (``restore_rng``) right before the next
    step, so nothing between here and there can consume it.
    """
    target = unwrap_model(model)
    target.load_state_dict(match_state_dict_to_model(target, ckpt["model"]))
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise ValueError("checkpoint has no 'optimizer' state but an optimizer was given")
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt.get("scheduler") is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if scaler is not None and ckpt.get("scaler") is not None and hasattr(scaler, "load_state_dict"):
        scaler.load_state_dict(ckpt["scaler"])
    restore_ema(ema, ckpt)  # the shadows continue, or (none saved) start from these weights
    return int(ckpt["next_step"])


def rng_state_for_rank(ckpt: Mapping[str, Any], rank: int) -> Any | None:
    """The RNG state this rank should restore, or None when the checkpoint holds none for it.

    Checkpoints written under DDP keep every rank's state in ``rng_per_rank`` (gathered by rank
    0); a single-process checkpoint keeps one in ``rng``, which belongs to rank 0.
    """
    per_rank = ckpt.get("rng_per_rank")
    if per_rank is not None:
        return per_rank[rank] if rank < len(per_rank) else None
    return ckpt.get("rng") if rank == 0 else None


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


def _encode(value: Any) -> Any:
    """NumPy arrays become tagged tuples of bytes; everything else is walked as is."""
    return _walk(value, _tag_ndarray)


def _decode(value: Any) -> Any:
    return _walk(value, _untag_ndarray)


def _walk(value: Any, leaf: Any) -> Any:
    """Rebuild dicts, lists and tuples, replacing whatever ``leaf`` turns into something else."""
    replaced = leaf(value)
    if replaced is not value:
        return replaced
    if isinstance(value, Mapping):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, leaf) for v in value]
    if isinstance(value, tuple):
        return tuple(_walk(v, leaf) for v in value)
    return value


def _tag_ndarray(value: Any) -> Any:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return value
    if isinstance(value, np.ndarray):
        return (_NDARRAY_TAG, value.dtype.str, list(value.shape), value.tobytes())
    return value


def _untag_ndarray(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _NDARRAY_TAG:
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

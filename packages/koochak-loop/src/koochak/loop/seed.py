"""Seeding and RNG state capture for reproducible runs.

`get_rng_state()` returns plain data (tensors, ints, floats, strings, lists, tuples) so a checkpoint
holding it loads with `torch.load(..., weights_only=True)`; numpy arrays are converted to tensors
on the way out and back on the way in.
"""

from __future__ import annotations

import functools
import random
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "check_rng_state",
    "get_rng_state",
    "make_worker_init_fn",
    "rng_world_note",
    "sample_generator",
    "set_all_seeds",
    "set_rng_state",
]

RNG_STATE_VERSION = 1
_RNG_KEYS = {"version", "python", "numpy", "torch", "cuda"}
_NUMPY_KEYS = {"bit_generator", "key", "pos", "has_gauss", "cached_gaussian"}


def _check_seed(seed: Any, name: str = "seed") -> int:
    # bool is an int subclass; a True seed is almost certainly a config mistake.
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(seed).__name__} {seed!r}")
    seed = int(seed)
    # NumPy's legacy seeding accepts only 32-bit seeds; refusing here beats a later surprise.
    if not 0 <= seed < 2**32:
        raise ValueError(f"{name} must be in [0, 2**32), got {seed}")
    return seed


def set_all_seeds(seed: int, cuda: bool = True) -> None:
    """Seed Python's `random`, NumPy's global RNG and torch (CPU, and CUDA when `cuda`).

    `torch.manual_seed` already queues the same seed for CUDA devices; `cuda=True` additionally
    seeds every visible CUDA device explicitly when CUDA is available. In DDP pass `seed + rank`
    so ranks do not draw correlated randomness.
    """
    seed = _check_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if cuda and torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def rng_world_note(saved: int, now: int) -> str | None:
    """What a resume on ``now`` ranks of a checkpoint written by ``saved`` ranks does to each
    rank's RNG (None when the counts agree): one line for rank 0 to log."""
    if saved == now:
        return None
    head = f"checkpoint was written by {saved} rank(s), resuming on {now}: "
    if now > saved:
        return (head + f"{_ranks(0, saved - 1)}: saved RNG stream continued; "
                f"{_ranks(saved, now - 1)}: no saved RNG state, seeded as at a fresh start "
                "(their randomness differs from an uninterrupted run)")  # fmt: skip
    return (head + f"{_ranks(0, now - 1)}: saved RNG stream continued; the saved RNG state of "
            f"{_ranks(now, saved - 1)} is not used, as no rank runs it now (randomness differs "
            f"from an uninterrupted run on {saved} rank(s))")  # fmt: skip


def _seed_worker(seed: int, rank: int, worker_id: int) -> None:
    # Mix in the worker's torch seed: the DataLoader draws it from the (seeded) main-process RNG
    # each time workers start, so each epoch gets fresh augmentations yet stays reproducible.
    sequence = np.random.SeedSequence([seed, rank, worker_id, torch.initial_seed() % 2**63])
    words = sequence.generate_state(2, dtype=np.uint32)
    worker_seed = int(words[0]) | (int(words[1]) << 32)
    random.seed(worker_seed)
    np.random.seed(int(words[0]))
    torch.manual_seed(worker_seed)


def sample_generator(seed: int, epoch: int, sample: int) -> torch.Generator:
    """A CPU ``torch.Generator`` of its own for one sample's randomness (augmentation, jitter).

    Seeded from the run's ``seed``, the ``epoch`` and the sample's id alone (NumPy's
    ``SeedSequence`` over the three), never from the global RNG or the worker: it gives the same
    numbers in a DataLoader worker or a collate function, on any rank, world size or worker
    count, in an uninterrupted and in a resumed run. ``ElasticBatches(keys=True)`` hands each
    record its ``(epoch, index)``: ``sample_generator(seed, *key)``. Draw with it explicitly
    (``torch.rand(..., generator=g)``); whatever draws from the global streams instead is not
    resumed in workers (docs/data.md, "Randomness and resume").
    """
    for name, value in (("seed", seed), ("epoch", epoch), ("sample", sample)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"sample_generator: {name} must be an int >= 0, got {value!r}")
    words = np.random.SeedSequence([int(seed), int(epoch), int(sample)]).generate_state(2)
    return torch.Generator().manual_seed(int(words[0]) | (int(words[1]) << 32))


def make_worker_init_fn(seed: int, rank: int = 0) -> Callable[[int], None]:
    """Return a DataLoader `worker_init_fn` giving each (rank, worker) its own seeded stream.

    The seeds derive from `seed`, `rank`, the worker id and the seed torch hands the worker (which
    comes from the main process RNG, so seed that too, e.g. with `set_all_seeds`). The result is
    a `functools.partial` of a module-level function, so it pickles for spawn-started workers.
    """
    seed = _check_seed(seed)
    rank = _check_seed(rank, "rank")
    return functools.partial(_seed_worker, seed, rank)


def get_rng_state() -> dict[str, Any]:
    """Capture Python, NumPy, torch CPU and (when available) CUDA RNG states as plain data."""
    version, internal, gauss_next = random.getstate()
    bit_generator, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_STATE_VERSION,
        "python": (int(version), tuple(int(x) for x in internal), gauss_next),
        "numpy": {
            "bit_generator": str(bit_generator),
            # uint32 words stored as int64: torch has no uint32 that weights_only round-trips everywhere.
            "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def check_rng_state(state: Any, where: str = "rng state") -> None:
    """Raise ValueError naming ``where`` unless ``state`` is one `set_rng_state` can restore.

    Each part is tried on a fresh generator (Python, NumPy, torch CPU), so nothing global
    changes and a state that would fail to restore mid-resume is refused up front instead.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(state).__name__}")
    unknown = set(state) - _RNG_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {sorted(map(str, unknown))}; expected {sorted(_RNG_KEYS)}"
        )
    version = state.get("version")
    if type(version) is not int or version != RNG_STATE_VERSION:
        raise ValueError(f"{where}: unsupported version {version!r}; expected {RNG_STATE_VERSION}")
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"{where}: missing key(s) {sorted(missing)}")
    try:
        random.Random().setstate(_python_state(state["python"]))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where} 'python': not a Python RNG state ({exc})") from None
    np_state = state["numpy"]
    if not isinstance(np_state, Mapping) or set(np_state) != _NUMPY_KEYS:
        keys = sorted(map(str, np_state)) if isinstance(np_state, Mapping) else np_state
        raise ValueError(f"{where} 'numpy': keys {keys!r} do not match {sorted(_NUMPY_KEYS)}")
    try:
        np.random.RandomState().set_state(_numpy_state(np_state))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"{where} 'numpy': not a NumPy RNG state ({exc})") from None
    _check_byte_state(state["torch"], f"{where} 'torch'")
    try:
        torch.Generator().set_state(state["torch"])
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{where} 'torch': not a torch CPU RNG state ({exc})") from None
    cuda = state.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, (list, tuple)):
            raise ValueError(f"{where} 'cuda': expected a list or null, got {type(cuda).__name__}")
        for index, device_state in enumerate(cuda):
            _check_byte_state(device_state, f"{where} 'cuda'[{index}]")


def _check_byte_state(value: Any, where: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError(f"{where}: expected a 1-D uint8 tensor, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _python_state(value: Any) -> tuple[Any, ...]:
    version, internal, gauss_next = value
    if isinstance(gauss_next, bool) or not (gauss_next is None or isinstance(gauss_next, float)):
        raise TypeError(f"gauss_next must be a float or None, got {gauss_next!r}")
    return (_exact_int(version), tuple(_exact_int(x) for x in internal), gauss_next)


def _numpy_state(np_state: Mapping[str, Any]) -> tuple[Any, ...]:
    key = np_state["key"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    if key.dtype.kind not in "iu":
        raise TypeError(f"key must hold integers, got dtype {key.dtype}")
    if not isinstance(np_state["bit_generator"], str):
        raise TypeError(f"bit_generator must be a str, got {np_state['bit_generator']!r}")
    return (
        np_state["bit_generator"],
        key.astype(np.uint32),
        _exact_int(np_state["pos"]),
        _exact_int(np_state["has_gauss"]),
        float(np_state["cached_gaussian"]),
    )


def _exact_int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a state produced by `get_rng_state` (also after a `torch.save`/`torch.load`).

    Unknown versions or keys, and parts that are not RNG states, are rejected (ValueError,
    `check_rng_state`) before anything is restored. CUDA states restore for the devices present
    in both the state and this process; a count mismatch warns because later CUDA draws will
    differ.
    """
    check_rng_state(state)
    random.setstate(_python_state(state["python"]))
    np.random.set_state(_numpy_state(state["numpy"]))

    torch.set_rng_state(state["torch"])

    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            warnings.warn(
                f"rng state holds {len(cuda_states)} CUDA device state(s) but {count} device(s) "
                f"are visible; restoring the first {min(count, len(cuda_states))}",
                stacklevel=2,
            )
        for index, device_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(device_state, index)

"""What every checkpoint read gets, whatever its layout: the payload's checks and decoding.

``checkpoint_of_payload`` (nesting bounded, format checked, RNG states decoded) is applied to
every payload a layout reads; ``deserialize_checkpoint`` / ``load_checkpoint_file`` turn the
one-file layout's bytes into one; ``with_fragment_rng`` puts back the RNG states a version-2
sharded head keeps in its writers' fragments (version 1) or RNG parts (version 2). Which layout a head is, is ``layouts.layout_of``'s
to say, nowhere else.
"""

from __future__ import annotations

import io
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from koochak.loop.checkpoint.format import check_checkpoint_format, untag_ndarrays
from koochak.loop.checkpoint.index_fragments import read_rng_part
from koochak.loop.checkpoint.parts_tree import check_depth, load_skeleton

if TYPE_CHECKING:
    from koochak.loop.checkpoint.parts_index import PartsIndex
    from koochak.storage.store import Store


__all__ = ["deserialize_checkpoint", "load_checkpoint_file", "checkpoint_of_payload",
           "with_fragment_rng"]  # fmt: skip


def with_fragment_rng(
    payload: Any,
    index: PartsIndex,
    source: str,
    store: Store | None = None,
    ranks: Collection[int] | None = None,
) -> Any:
    """``payload`` with ``rng_per_rank`` rebuilt from the writers' own RNG states (index
    version 2, where the head holds none of them): a state per writer whose fragment was read,
    None for the others. Fragment version 1 carries the state itself; version 2 names the
    writer's RNG part, read (verified) from ``store`` for the writers in ``ranks`` only (None:
    every one read): a resuming rank reads its own and nobody else's. Writer 0's state is the
    checkpoint's ``rng`` field, as in a one-process checkpoint."""
    if not isinstance(payload, dict) or payload.get("rng_per_rank") is not None:
        return payload
    states = index.rng
    if any(states):
        payload["rng_per_rank"] = [
            None if blob is None else load_skeleton(blob, source) for blob in states
        ]
    elif any(index.rng_parts):
        per_rank: list[Any] = [None] * len(index.rng_parts)
        per_rank[0] = payload.get("rng")
        for writer, part in enumerate(index.rng_parts):
            if part is None or (ranks is not None and writer not in ranks):
                continue
            if store is None:
                raise ValueError(f"{source}: RNG part {part.key} needs the store that holds it")
            per_rank[writer] = load_skeleton(read_rng_part(store, part, source), source)
        payload["rng_per_rank"] = per_rank
    return payload


# -- the one-file layout's bytes, and the checks every read payload gets ------------------


def deserialize_checkpoint(data: bytes | bytearray | memoryview, source: str) -> dict[str, Any]:
    """Load checkpoint bytes onto the CPU with ``weights_only=True`` and check the format.

    ``source`` names the file in errors. Every way the payload can fail to decode is a
    ValueError naming ``source``: bytes torch cannot load, a payload that needs arbitrary
    unpickling (a code object, a class), a dict of an unknown version or with unknown keys, a
    field of the wrong type, an array record that does not decode. (Resume relies on this: a
    candidate that raises ValueError is skipped, never a crash.)
    """
    return _loaded(
        lambda: torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True), source
    )


def load_checkpoint_file(path: str, source: str) -> dict[str, Any]:
    """``deserialize_checkpoint`` of a ``torch.save`` zip file, mapped rather than read: the
    tensors are views of the file's pages (``torch.load(mmap=True)``), so nothing is copied
    until they are restored. Verify the file first (``verified_read``); errors as there."""
    return _loaded(
        lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), source
    )


def _loaded(load: Any, source: str) -> dict[str, Any]:
    try:
        ckpt = load()
    except (MemoryError, OSError):
        raise
    except Exception as exc:  # torch raises many types for hostile bytes; all mean "not loadable"
        raise ValueError(
            f"{source}: not a loadable weights-only checkpoint ({_first_line(exc)})"
        ) from exc
    return checkpoint_of_payload(ckpt, source)


def checkpoint_of_payload(ckpt: Any, source: str) -> dict[str, Any]:
    """Check a loaded payload's format and decode its RNG states; ValueError naming ``source``
    (InvalidArtifact for containers nested past ``parts_tree.MAX_DEPTH``, measured without
    recursion before anything walks them)."""
    check_depth(ckpt, source)
    check_checkpoint_format(ckpt, source)
    for key in ("rng", "rng_per_rank"):
        if ckpt.get(key) is not None:
            try:
                ckpt[key] = untag_ndarrays(ckpt[key])
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

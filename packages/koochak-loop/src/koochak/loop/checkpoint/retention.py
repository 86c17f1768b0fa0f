"""Retention: which committed checkpoints a tier drops. One rule for every layout and tier.

``judge`` is the whole rule, a pure function of names: keep the newest ``keep_last_k``, the
best (``keep_best_k``), whatever is being copied, and (in a first tier backed by replicas)
whatever no durable tier holds yet unless ``train.checkpoint_prune_unreplicated``; never the
newest committed checkpoint, whatever else is asked. The saver, every replica tier, the
replication queues and ``publication.prune_checkpoints`` all decide through it, so a rule
changes in one place.

``BestCheckpoints`` ranks checkpoints by ``train.keep_best_metric``: what ``judge`` takes as
``best``. ``publication.remove_checkpoints`` applies a verdict to a store (manifest first, then object,
then parts).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, step_of_name
from koochak.loop.checkpoint.parts_index import PART_INFIX
from koochak.storage import artifact
from koochak.storage.store import Store

log = logging.getLogger("koochak.loop.checkpoint")


class Verdict(NamedTuple):
    """What retention does with a tier's committed checkpoints."""

    drop: list[str]  # to remove, newest first
    held: list[str]  # beyond keep_last_k, kept only because no durable tier holds them yet


def judge(
    committed: Sequence[str],
    *,
    keep_last_k: int | None,
    best: Collection[str] = (),
    in_flight: Collection[str] = (),
    durable: Collection[str] | None = None,
    prune_unreplicated: bool = False,
) -> Verdict:
    """Which of ``committed`` (names, newest first) a tier drops.

    ``keep_last_k`` None keeps every one. ``best``: spared whatever their age (keep_best_k).
    ``in_flight``: being copied to or from this tier right now (dropped once that ends).
    ``durable``: the names some durable tier holds, for a first tier backed by replicas (None:
    this tier is durable itself, or has no replicas); the others are held unless
    ``prune_unreplicated``. The newest committed checkpoint is never dropped.
    """
    if keep_last_k is not None and (isinstance(keep_last_k, bool) or keep_last_k < 0):
        raise ValueError(f"keep_last_k must be None or >= 0, got {keep_last_k!r}")
    if keep_last_k is None:
        return Verdict([], [])
    drop: list[str] = []
    held: list[str] = []
    for name in list(committed)[max(keep_last_k, 1) :]:
        if name in best or name in in_flight:
            continue
        if durable is not None and name not in durable and not prune_unreplicated:
            held.append(name)
            continue
        drop.append(name)
    return Verdict(drop, held)


def to_drop(committed: Sequence[str], **rules: Any) -> list[str]:
    """``judge(committed, **rules).drop``: the names to remove."""
    return judge(committed, **rules).drop


def committed(store: Store) -> list[tuple[int, str]]:
    """``(step, name)`` of the numbered checkpoints committed in ``store``, newest first, from
    one listing of the checkpoints and their manifests, none of their parts
    (``koochak.storage.list_shallow``): it grows with the checkpoints kept, not their parts."""
    return artifact.published_candidates(store, CHECKPOINT_PATTERN, leave_out=PART_INFIX)


def committed_names(store: Store) -> list[str]:
    """The numbered checkpoints committed in ``store``, newest first (``committed``)."""
    return [name for _, name in committed(store)]


def score(value: Any) -> float | None:
    """A metric value usable for ranking: a finite real number, else None."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


class BestCheckpoints:
    """The ``k`` best checkpoints by ``metric`` (``mode`` "min" or "max"; ties: the newer).

    ``note`` a save's metrics as it is made; a checkpoint not noted (an earlier attempt's) is
    read once from its store. A checkpoint without the metric is never among the best.
    """

    def __init__(self, k: int, metric: str, mode: str = "min") -> None:
        self.k, self.metric, self.mode = k, metric, mode
        self._scores: dict[str, float | None] = {}

    def note(self, name: str, metrics: Mapping[str, Any] | None) -> None:
        self._scores[name] = score((metrics or {}).get(self.metric))

    def forget(self, name: str) -> None:
        self._scores.pop(name, None)

    def best(self, store: Store, names: Iterable[str]) -> set[str]:
        """The ``k`` best of ``names`` (committed in ``store``)."""
        scored = [(self._score_of(store, n), -(step_of_name(n) or 0), n) for n in names]
        ranked = sorted(
            (t for t in scored if t[0] is not None),
            key=lambda t: (t[0] if self.mode == "min" else -t[0], t[1]),
        )
        return {name for _, _, name in ranked[: self.k]}

    def _score_of(self, store: Store, name: str) -> float | None:
        if name not in self._scores:
            from koochak.loop.checkpoint.layouts import read_checkpoint

            try:
                _, data = artifact.read_verified(store, name)
                metrics = read_checkpoint(store, name, data, name).get("metrics") or {}
                self._scores[name] = score(metrics.get(self.metric))
            except (artifact.InvalidArtifact, ValueError, OSError) as exc:
                log.warning("keep_best_k: cannot read %s (%s); it is ranked as not best", name, exc)
                self._scores[name] = None
        return self._scores[name]


def best_of(keep_best: tuple[int, str, str] | None) -> BestCheckpoints | None:
    """A tracker for ``(keep_best_k, keep_best_metric, keep_best_mode)``, or None."""
    return BestCheckpoints(*keep_best) if keep_best is not None else None

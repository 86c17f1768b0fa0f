"""Logged metrics across DDP ranks: the run's value, not rank 0's shard's.

On a logging step every rank holds its own step_fn scalars (its shard's loss, accuracy ...) and its
own step time. `reduce_logged` turns them into the mean over ranks with ONE collective: every
rank's values are gathered as one small float64 vector (the step times ride along, so the
slowest and fastest rank come from the same call). Eval metrics of a sharded eval set are
weighted by each rank's number of eval batches (`reduce_eval`), again in one collective.

A metric named in ``exclude`` keeps this rank's value (rank 0's is what gets logged). Every rank
must report the same metric names: the vectors are built in sorted name order and must line up.
Nothing here runs on ordinary steps; the loop calls it on logging steps and after evaluations.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
from koochak.loop import dist

__all__ = ["CountedBatches", "reduce_eval", "reduce_logged"]

# Metrics that are the same on every rank already: averaging them would only cost precision.
_GLOBAL = frozenset({"lr", "grad_norm", "grad_norm_rescaled", "grad_clip_coefficient",
                     "grad_clip_scaled_norm"})  # fmt: skip


def _gather(values: list[float], device: torch.device | None) -> list[list[float]]:
    from koochak.loop.ddp import collective_device

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [values]
    return dist.all_gather_floats(values, device if device is not None else collective_device())


def reduce_logged(
    metrics: Mapping[str, float],
    step_time: float,
    *,
    exclude: Collection[str] = (),
    device: torch.device | None = None,
) -> tuple[dict[str, float], list[float]]:
    """(metrics with each reducible value replaced by its mean over ranks, every rank's
    ``step_time``). Single process: the metrics unchanged and ``[step_time]``."""
    names = sorted(k for k in metrics if k not in exclude and k not in _GLOBAL)
    rows = _gather([*(float(metrics[k]) for k in names), float(step_time)], device)
    reduced = dict(metrics)
    for i, name in enumerate(names):
        reduced[name] = sum(row[i] for row in rows) / len(rows)
    return reduced, [row[-1] for row in rows]


def reduce_eval(
    metrics: Mapping[str, float],
    batches: int,
    *,
    exclude: Collection[str] = (),
    device: torch.device | None = None,
) -> dict[str, float]:
    """Eval metrics averaged over ranks, each rank weighted by its number of eval ``batches``
    (a rank with an empty shard counts for nothing). Single process: unchanged."""
    names = sorted(k for k in metrics if k not in exclude)
    rows = _gather([float(batches), *(float(metrics[k]) * batches for k in names)], device)
    total = sum(row[0] for row in rows)
    reduced = dict(metrics)
    if total > 0:
        for i, name in enumerate(names, start=1):
            reduced[name] = sum(row[i] for row in rows) / total
    return reduced


class CountedBatches:
    """``dataset`` as eval_fn sees it, counting the batches its iterators yield (``count``);
    length and attributes are the dataset's own."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataset:
            self.count += 1
            yield batch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)

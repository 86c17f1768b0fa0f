"""What the loop checks about the data it is handed: does a resumed run see the same batches?

A torch ``DataLoader`` with a random sampler (``shuffle=True``, ``RandomSampler``, a shuffling
``DistributedSampler``), and ``itertools.cycle`` or ``koochak.loop.batch.cycle`` over one, starts
a fresh shuffle when a resumed run iterates it again: the resumed run trains on other batches
than an uninterrupted one would have, silently. `resume_note` recognises these and says what to
use instead (an elastic stream, ``koochak.loop.elastic``, which keeps its cursor in every
checkpoint); the loop prints it once at start.

`keep_rng_on_iter` makes starting a DataLoader's iteration leave the global torch RNG as it was:
``iter(loader)`` draws the workers' base seed from it, which happens at a fresh run's first
batch and again at a resumed run's first batch, so a resumed run's dropout masks would otherwise
differ from an uninterrupted run's from then on.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from koochak.loop import batch
from koochak.loop.elastic import find_elastic
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

__all__ = ["keep_rng_on_iter", "resume_note", "say_if_not_resumable"]

_INSTEAD = (
    "for an exact resume use koochak.loop.elastic.ElasticBatches (or elastic_sampler as the "
    "DataLoader's batch_sampler), whose cursor every checkpoint keeps"
)


def resume_note(dataset: Any) -> str | None:
    """One line when ``dataset`` is known to resume on other batches than an uninterrupted run
    would see (a shuffling DataLoader, or a cycle over a DataLoader); None otherwise."""
    if find_elastic(dataset) is not None:
        return None
    cycled = _cycled(dataset)
    if cycled is not None and isinstance(cycled, (DataLoader, _BaseDataLoaderIter)):
        what = "a shuffling DataLoader" if _sampler_of(cycled) else "a DataLoader"
        return (f"the dataset is a cycle over {what}: a resumed run starts its passes afresh "
                f"and sees other batches than an uninterrupted run; {_INSTEAD}")  # fmt: skip
    sampler = _sampler_of(dataset)
    if sampler is not None:
        return (f"the dataset is a DataLoader with a random sampler ({sampler}): a resumed run "
                f"reshuffles and sees other batches than an uninterrupted run; {_INSTEAD}")  # fmt: skip
    return None


def say_if_not_resumable(dataset: Any, rank: int) -> Iterable[Any]:
    """The loop's one call: print `resume_note` once (rank 0) and return the dataset to iterate
    (`keep_rng_on_iter` of it)."""
    note = resume_note(dataset)
    if note is not None and rank == 0:
        print(f"koochak: {note}", flush=True)
    return keep_rng_on_iter(dataset)


def keep_rng_on_iter(dataset: Any) -> Any:
    """``dataset``, or for a DataLoader a view of it whose ``iter`` leaves the global torch RNG
    untouched (the base seed it draws comes from the same state as before)."""
    return _DataLoaderView(dataset) if isinstance(dataset, DataLoader) else dataset


class _DataLoaderView:
    """Iterates its DataLoader; the draw ``iter`` makes is taken back (workers still get it)."""

    def __init__(self, loader: DataLoader) -> None:  # type: ignore[type-arg]
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        state = torch.get_rng_state()
        try:
            return iter(self.loader)
        finally:
            torch.set_rng_state(state)

    def __len__(self) -> int:
        return len(self.loader)

    # What `find_elastic` (and DDP's sharding, through it) looks for behind a DataLoader.
    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler


def _sampler_of(source: Any) -> str | None:
    """The name of the random sampler behind a DataLoader (or a DataLoader's iterator), else
    None."""
    if isinstance(source, DataLoader):
        sampler: Any = source.batch_sampler if source.batch_sampler is not None else source.sampler
    else:
        sampler = getattr(source, "_index_sampler", None)  # a DataLoader iterator's
    if isinstance(sampler, BatchSampler):
        sampler = sampler.sampler
    if isinstance(sampler, RandomSampler):
        return "RandomSampler, e.g. shuffle=True"
    if isinstance(sampler, DistributedSampler) and sampler.shuffle:
        return "DistributedSampler(shuffle=True)"
    return None


def _cycled(dataset: Any) -> Any:
    """What ``itertools.cycle`` or ``koochak.loop.batch.cycle`` repeats (for itertools, the
    iterator it was handed), or None when ``dataset`` is neither."""
    if isinstance(dataset, itertools.cycle):
        inner = [o for o in gc.get_referents(dataset) if not isinstance(o, list)]
        return inner[0] if inner else None
    frame = getattr(dataset, "gi_frame", None)
    if frame is not None and getattr(dataset, "gi_code", None) is batch.cycle.__code__:
        return frame.f_locals.get("iterable")
    return None

"""Reusable host buffers that freeze a state's tensors for a save that persists in the background.

An async save must publish the values of the step it describes while training moves on and
changes them in place. The training thread's only work is one copy of every tensor into a host
buffer; writers then read the buffers while training continues. The buffers are kept and reused
by the next save (pinned on CUDA, so the device-to-host copies run at full speed and can be
issued without waiting on each), so a run holds one state's worth of host memory for saving, not
one per save. A buffer is never reused while a writer still reads it: ``copy`` waits until the
previous copy has been released.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch


class HostCopy:
    """Host copies of a state's tensors, valid until ``release()``; ``tensors[i]`` is source i."""

    def __init__(self, tensors: list[torch.Tensor], owner: HostBuffers) -> None:
        self.tensors = tensors
        self._owner = owner
        self._released = False

    def release(self) -> None:
        """Hand the buffers back for the next save (idempotent); call once nothing reads them."""
        if not self._released:
            self._released = True
            self._owner._release()

    def __enter__(self) -> HostCopy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class HostBuffers:
    """One state's worth of host buffers, copied into by one save at a time.

    ``copy(tensors)`` waits until the previous ``HostCopy`` is released, copies each tensor into
    a buffer of the same dtype and shape (reused from the previous save when one matches,
    allocated otherwise; buffers the new state no longer needs are dropped first, so memory
    follows the state's size and never accumulates), and returns the copy. Sources on CUDA go
    into pinned buffers with asynchronous copies and one wait per device at the end.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._free = threading.Event()
        self._free.set()

    @property
    def nbytes(self) -> int:
        """Bytes held in buffers right now."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers held right now (for tests and accounting)."""
        return tuple(self._buffers)

    def copy(self, tensors: Sequence[torch.Tensor], timeout: float | None = None) -> HostCopy:
        """Copy ``tensors`` into the buffers; blocks while the previous copy is still in use."""
        if not self._free.wait(timeout):
            raise TimeoutError(
                f"host buffers still in use by the previous save after {timeout} s; "
                "a save's writer must release its HostCopy"
            )
        self._free.clear()
        try:
            targets = self._match(tensors)
            devices: dict[torch.device, None] = {}
            for target, source in zip(targets, tensors):
                source = source.detach()
                if source.device.type == "cuda":
                    target.copy_(source, non_blocking=True)
                    devices[source.device] = None
                else:
                    target.copy_(source)
            for device in devices:
                # The copies were queued on each device's current stream, after the kernels
                # that produced the values; wait once for all of them.
                torch.cuda.current_stream(device).synchronize()
        except BaseException:
            self._free.set()
            raise
        return HostCopy(targets, self)

    def _match(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        pool: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for buffer in self._buffers:
            pool.setdefault(_kind(buffer, buffer.is_pinned()), []).append(buffer)
        wanted = [_kind(t, t.device.type == "cuda") for t in tensors]
        targets: list[torch.Tensor | None] = [
            pool[kind].pop() if pool.get(kind) else None for kind in wanted
        ]
        # Drop what the new state does not use before allocating what it lacks, so memory
        # moves from one state's size to the next and never holds both.
        self._buffers = [t for t in targets if t is not None]
        pool.clear()
        out = []
        for target, kind in zip(targets, wanted):
            if target is None:
                dtype, shape, pinned = kind
                target = torch.empty(shape, dtype=dtype, pin_memory=pinned)
                self._buffers.append(target)
            out.append(target)
        return out

    def _release(self) -> None:
        self._free.set()


def _kind(tensor: torch.Tensor, pinned: bool) -> tuple[torch.dtype, tuple[int, ...], bool]:
    return (tensor.dtype, tuple(tensor.shape), bool(pinned))

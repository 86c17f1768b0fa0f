"""HostBuffers: one state's worth of reused host memory, never reused while a writer reads it."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
from koochak.loop.checkpoint.host_buffers import HostBuffers


def _state(scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.full((64, 32), scale), torch.arange(10), torch.ones(3, dtype=torch.bfloat16)]


def test_a_copy_holds_the_values_of_when_it_was_taken():
    state = _state()
    buffers = HostBuffers()
    copy = buffers.copy(state)
    for tensor in state:
        tensor.add_(1)  # training moves on
    assert torch.equal(copy.tensors[0], torch.full((64, 32), 1.0))
    assert torch.equal(copy.tensors[1], torch.arange(10))
    assert all(c.data_ptr() != s.data_ptr() for c, s in zip(copy.tensors, state))
    copy.release()


def test_buffers_are_reused_and_memory_does_not_grow_over_many_saves():
    state = _state()
    buffers = HostBuffers()
    with buffers.copy(state) as first:
        pointers = [t.data_ptr() for t in first.tensors]
    size = sum(t.numel() * t.element_size() for t in state)
    for step in range(100):
        for tensor in state:
            tensor.fill_(step)
        with buffers.copy(state) as copy:
            assert [t.data_ptr() for t in copy.tensors] == pointers
            assert all(torch.equal(c, s) for c, s in zip(copy.tensors, state))
        assert buffers.nbytes == size


def test_a_changed_state_drops_unused_buffers_and_keeps_matching_ones():
    buffers = HostBuffers()
    state = _state()
    with buffers.copy(state) as copy:
        kept = copy.tensors[1].data_ptr()
    grown = [state[1], torch.zeros(5, 5)]  # the big tensor is gone, a new one appeared
    with buffers.copy(grown) as copy:
        assert copy.tensors[0].data_ptr() == kept
    assert buffers.nbytes == 10 * 8 + 25 * 4
    assert len(buffers.buffers) == 2


def test_a_copy_waits_until_the_previous_one_is_released():
    buffers = HostBuffers()
    state = _state()
    first = buffers.copy(state)
    with pytest.raises(TimeoutError, match="still in use by the previous save"):
        buffers.copy(state, timeout=0.01)
    assert torch.equal(first.tensors[0], state[0])  # the writer's bytes were not touched
    done = threading.Event()

    def second() -> None:
        with buffers.copy(state):
            done.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not done.wait(0.05)  # blocked while the first copy is held
    first.release()
    first.release()  # idempotent
    thread.join(10)
    assert done.is_set()


def test_a_failed_copy_frees_the_buffers_for_the_next_save():
    buffers = HostBuffers()
    with pytest.raises(RuntimeError):
        buffers.copy([torch.zeros(2), torch.empty(2, device="meta")])
    with buffers.copy(_state()) as copy:
        assert len(copy.tensors) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_a_background_thread_lowers_its_priority_and_its_children_inherit_it():
    from koochak.loop.checkpoint.background import BACKGROUND_NICENESS, lower_this_threads_priority

    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def background() -> None:
        seen["lowered"] = lower_this_threads_priority()
        thread = threading.Thread(target=child)
        thread.start()
        thread.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["lowered"] is True
    assert seen["child"] >= BACKGROUND_NICENESS
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host buffers)")
def test_cuda_tensors_go_into_pinned_buffers_that_are_reused():
    state = [t.cuda() for t in _state()]
    buffers = HostBuffers()
    with buffers.copy(state) as copy:
        assert all(t.is_pinned() and t.device.type == "cpu" for t in copy.tensors)
        pointers = [t.data_ptr() for t in copy.tensors]
        for tensor in state:
            tensor.add_(1)  # queued after the copy on the same stream
        assert torch.equal(copy.tensors[0], torch.full((64, 32), 1.0))
    with buffers.copy(state) as copy:
        assert [t.data_ptr() for t in copy.tensors] == pointers
        assert torch.equal(copy.tensors[0], torch.full((64, 32), 2.0))

"""Async saves without harm: published bytes are the step's, memory stays flat, kill -9 is safe."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from koochak.loop.checkpoint import (
    CHECKPOINT_PATTERN,
    CheckpointPublishError,
    build_checkpoint,
    checkpoint_name,
    load,
    resolve_auto_resume,
)
from koochak.loop.checkpoint.saver import CheckpointSaver
from koochak.storage import artifact
from koochak.storage.store import LocalStore


class GatedStore(LocalStore):
    """A LocalStore whose puts wait until ``gate`` is set: nothing is written before that."""

    def __init__(self, root) -> None:
        super().__init__(root, fsync=False)
        self.gate = threading.Event()
        self.gate.set()
        self.priorities: list[int] = []

    def put(self, key, data, **kwargs):
        assert self.gate.wait(30), "the test never opened the gate"
        self.priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return super().put(key, data, **kwargs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))


@pytest.mark.slow
@pytest.mark.parametrize("parts", [3, 1])
def test_mutating_every_parameter_after_save_returns_never_reaches_the_file(tmp_path, parts):
    """1,000 of 1,000 trials publish the values of the step, not the ones training made next.

    Each save is held at the store's door until the parameters have been changed in place, so
    every byte is written after the mutation: only a copy taken before ``save`` returned can
    hold the old values.
    """
    store = GatedStore(tmp_path)
    saver = CheckpointSaver(store, async_publish=True, parts=parts, keep_last_k=2)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    for trial in range(1000):
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        store.gate.clear()
        saver.save(build_checkpoint(step=trial, next_step=trial + 1, model=model,
                                    optimizer=optimizer))  # fmt: skip
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
                optimizer.state[p]["momentum_buffer"].mul_(-1)
        store.gate.set()
        saver.drain()
        published = load(store, checkpoint_name(trial))
        for key, value in expected.items():
            assert torch.equal(published["model"][key], value), (trial, key)
        for i, value in enumerate(momentum):
            assert torch.equal(published["optimizer"]["state"][i]["momentum_buffer"], value)
    assert max(store.priorities) > os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_async_save_in_parts_reuses_one_set_of_host_buffers(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    saver = CheckpointSaver(store, async_publish=True, parts=2, keep_last_k=1)
    model = _model()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    pointers = None
    for step in range(5):
        saver.save(build_checkpoint(step=step, next_step=step + 1, model=model))
        saver.drain()
        now = [b.data_ptr() for b in saver._buffers.buffers]
        assert pointers is None or now == pointers
        pointers = now
        assert saver._buffers.nbytes == size
    path, ckpt = resolve_auto_resume(store)
    assert ckpt["step"] == 4


class FailingStore(LocalStore):
    def put(self, key, data, **kwargs):
        if ".part-" in key:
            raise OSError(28, "No space left on device", key)
        return super().put(key, data, **kwargs)


def test_a_failed_background_save_in_parts_fails_the_next_step_and_frees_the_buffers(tmp_path):
    saver = CheckpointSaver(FailingStore(tmp_path), async_publish=True, parts=2)
    model = _model()
    saver.save(build_checkpoint(step=0, next_step=1, model=model))
    saver._async._thread.join()
    with pytest.raises(CheckpointPublishError, match="No space left on device"):
        saver.poll()
    assert [p.name for p in tmp_path.iterdir()] == []
    saver.save(build_checkpoint(step=1, next_step=2, model=model))  # buffers were released
    saver.close()


def test_a_synchronous_save_after_an_async_one_waits_for_it(tmp_path):
    store = GatedStore(tmp_path)
    saver = CheckpointSaver(store, async_publish=True, parts=2)
    model = _model()
    store.gate.clear()
    saver.save(build_checkpoint(step=0, next_step=1, model=model))
    threading.Timer(0.05, store.gate.set).start()
    path = saver.save(build_checkpoint(step=1, next_step=1, model=model, reason="terminal"),
                      sync=True)  # fmt: skip
    assert path.endswith("step000000001.pt")
    assert artifact.published_candidates(store, CHECKPOINT_PATTERN) == [
        (1, "step000000001.pt"),
        (0, "step000000000.pt"),
    ]


# -- memory: one state's worth, not growing ---------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent(
    """
    import gc, sys, torch
    from koochak.loop.checkpoint import build_checkpoint
    from koochak.loop.checkpoint.saver import CheckpointSaver
    from koochak.storage.store import LocalStore

    def rss():
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])  # ~32 MiB
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    saver = CheckpointSaver(LocalStore(sys.argv[1], fsync=False), async_publish=True,
                            parts=int(sys.argv[2]), keep_last_k=2)
    gc.collect()
    base, _ = rss()
    after = []
    for step in range(100):
        saver.save(build_checkpoint(step=step, next_step=step + 1, model=model))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.999)  # training goes on while the save persists
        saver.drain()
        after.append(rss()[0])
    _, peak = rss()
    print(size, base, peak, after[9], after[-1])
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("parts", [2, 1])
def test_async_saves_hold_one_state_of_host_memory_and_do_not_grow(tmp_path, parts):
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "ckpt"), str(parts)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    size, base, peak, tenth, last = map(int, result.stdout.split())
    mib = 1 << 20
    assert peak - base <= size + 64 * mib, (peak - base) / mib
    assert last - tenth <= 8 * mib, (last - tenth) / mib  # no growth from save 10 to save 100


# -- kill -9 at random points of parallel, async saves ---------------------------------------

_KILL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from koochak.loop.checkpoint import build_checkpoint
    from koochak.loop.checkpoint.saver import CheckpointSaver

    torch.manual_seed(int(sys.argv[2]))
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB
    saver = CheckpointSaver(sys.argv[1], async_publish=True, parts=3)
    step = int(sys.argv[3])
    print("ready", flush=True)
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))  # every value says which step it belongs to
        saver.save(build_checkpoint(step=step, next_step=step + 1, model=model))
        step += 1
    """
)


@pytest.mark.slow
def test_kill_9_at_random_points_of_parallel_async_saves_leaves_nothing_selectable(tmp_path):
    root = tmp_path / "ckpt"
    rng = random.Random(1234)
    start = 0
    for trial in range(8):
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILL_SCRIPT, str(root), str(trial), str(start)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        store = LocalStore(root)
        # Every committed checkpoint is whole and holds its own step's values; anything else
        # (parts without an index, an index without a manifest) is never selected.
        for number, name in artifact.published_candidates(store, CHECKPOINT_PATTERN):
            ckpt = load(store, name)
            assert all(float(t.flatten()[0]) == number for t in ckpt["model"].values())
        found = resolve_auto_resume(root)
        if found is not None:
            assert (
                found.checkpoint["step"]
                == artifact.published_candidates(store, CHECKPOINT_PATTERN)[0][0]
            )
            start = found.checkpoint["next_step"]  # the next attempt re-saves later steps

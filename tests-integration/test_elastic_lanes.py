"""The exact elastic cursor at shard granularity: ``ElasticBatches(lanes=8)`` over ``ShardRecords``
in shard order, on 1, 2 and 4 ranks. Each rank reads at most 1.5 x D / W plus two shards per
epoch (without lanes: every shard), every record is read once per epoch across the ranks, and a
stream cut on one world size continues on another exactly where it stopped; a training run over
packed records with lanes and a shuffle window, killed with SIGKILL twice, trains on exactly the
batches of an uninterrupted run (this file is also that run's script)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import koochak.data.records as records_module
import pytest
from koochak.data.records import ShardRecords
from koochak.data.shards import ShardWriter
from koochak.loop.elastic import ElasticBatches, UnpackedRecords
from koochak.storage.store import LocalStore

N, GLOBAL_BATCH, LANES = 4096, 32, 8
PER = 4  # records per sample in the packed dataset


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = LocalStore(str(tmp_path_factory.mktemp("lanes")))
    with ShardWriter(store, "ds", target_bytes=64 << 10) as writer:  # 64 records a shard
        for i in range(N):
            writer.write({"__key__": f"r{i:05d}", "txt": f"{i:05d}".encode() * 20})
    with ShardWriter(store, "packed", target_bytes=16 << 10) as writer:  # 16 samples a shard
        for s in range(0, N, PER):
            writer.write({"__key__": f"s{s:05d}", "txt": b"".join(
                f"{i:05d}".encode() * 20 for i in range(s, s + PER))})  # fmt: skip
    return store


@pytest.fixture
def bytes_read(monkeypatch):
    """Bytes of the shards ShardRecords reads (whole shards, verified), summed."""
    total = [0]
    real = records_module.read_shard

    def counted(store, index, entry, **kwargs):
        total[0] += entry.size
        return real(store, index, entry, **kwargs)

    monkeypatch.setattr(records_module, "read_shard", counted)
    return total


def _unpack(sample) -> list[str]:
    text = bytes(sample["txt"]).decode()
    return [f"r{text[i : i + 5]}" for i in range(0, len(text), 100)]


def _stream(store, world, rank, *, lanes=LANES, packed=False, state=None, **settings):
    samples = ShardRecords(
        store, "packed" if packed else "ds", cached_shards=2 * LANES // world + 1
    )
    if packed:
        records = UnpackedRecords(samples, PER, _unpack)
        order = records.expand(samples.shard_order(seed=5))
        collate = list
    else:
        records, order = samples, samples.shard_order(seed=5)

        def collate(batch):
            return [r["__key__"] for r in batch]

    data = ElasticBatches(records, global_batch=GLOBAL_BATCH, order=order, collate=collate,
                          rank=rank, world_size=world, lanes=lanes, **settings)  # fmt: skip
    if state is not None:
        data.load_state(state)
    return data, samples.index


def _epoch(store, world, bytes_read, **settings):
    """Each rank's one epoch, read rank after rank: (records per rank, bytes per rank, index)."""
    seen, reads = [], []
    for rank in range(world):
        before = bytes_read[0]
        data, index = _stream(store, world, rank, **settings)
        batches = list(itertools.islice(iter(data), N // GLOBAL_BATCH))
        seen.append([k for b in batches for k in b])
        reads.append(bytes_read[0] - before)
    return seen, reads, index


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "settings", [{}, {"shuffle_window": 16}, {"packed": True}], ids=["plain", "window", "packed"]
)
def test_each_rank_reads_its_share_of_the_shards_and_every_record_once(
    store, bytes_read, world, settings
):
    seen, reads, index = _epoch(store, world, bytes_read, **settings)
    assert len(index.shards) >= 64
    assert sorted(k for part in seen for k in part) == [f"r{i:05d}" for i in range(N)]
    bound = 1.5 * index.size / world + 2 * max(s.size for s in index.shards)
    assert max(reads) <= bound, (reads, bound)
    if world == 4:  # without lanes every rank reads (nearly) every shard
        _, whole, _ = _epoch(store, world, bytes_read, lanes=1, **settings)
        assert min(whole) > 0.9 * index.size and max(reads) < 0.4 * index.size


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 1), (1, 4)])
def test_a_laned_stream_resumed_on_another_world_size_is_exact(store, before, after):
    def global_batches(world, count, state=None, packed=False):
        parts = [list(itertools.islice(iter(_stream(store, world, r, state=state,
                                                    packed=packed)[0]), count))
                 for r in range(world)]  # fmt: skip
        return [sum(step, []) for step in zip(*parts)]

    for packed in (False, True):
        uninterrupted = global_batches(1, 40, packed=packed)  # past the epoch's end
        cut = _stream(store, before, 0, packed=packed)[0].state_after(13)
        resumed = global_batches(before, 13, packed=packed) + global_batches(
            after, 27, cut, packed=packed
        )
        assert resumed == uninterrupted
        assert cut["order"].endswith("+lanes8")


def test_a_resume_with_other_lanes_is_refused(store):
    state = _stream(store, 2, 0)[0].state_after(3)
    other, _ = _stream(store, 2, 0, lanes=4)
    with pytest.raises(ValueError, match=r"field 'data.order' is 'shard_order\(seed=5\)\+lanes8'"):
        other.load_state(state)


def train(root: str, out: str, kill_at: int) -> None:
    """The script: 12 updates over the packed records (lanes, shuffle window), a checkpoint every
    4; every update appends its step and record ids to ``out/ids.txt``; SIGKILL inside update
    ``kill_at``."""
    import torch
    from koochak.loop import training_loop

    store = LocalStore(root)
    samples = ShardRecords(store, "packed", cached_shards=2 * LANES + 1)
    records = UnpackedRecords(samples, PER, _unpack)
    data = ElasticBatches(records, global_batch=GLOBAL_BATCH, lanes=LANES, shuffle_window=16,
                          order=records.expand(samples.shard_order(seed=5)), collate=list)  # fmt: skip

    def step_fn(model, batch, ctx):
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        with open(os.path.join(out, "ids.txt"), "a") as f:
            f.write(f"{ctx.step} {' '.join(batch)}\n")
        x = torch.tensor([[float(r[1:])] for r in batch])
        return {"loss": model(x).pow(2).mean()}

    training_loop(
        model=torch.nn.Linear(1, 1), dataset=data, step_fn=step_fn,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=1e-9),
        train_cfg={"max_steps": 12, "ckpt_every": 4, "device": "cpu", "out_dir": out,
                   "progress_bar": False, "log_every": 100},
        resume="auto",
    )  # fmt: skip


def _steps(out) -> dict[str, str]:
    with open(os.path.join(out, "ids.txt")) as f:
        return dict(line.split(" ", 1) for line in f)  # the last attempt's line of each step


@pytest.mark.slow
def test_a_laned_packed_stream_killed_twice_trains_on_the_uninterrupted_batches(store, tmp_path):
    def launch(out, kill_at):
        os.makedirs(out, exist_ok=True)
        return subprocess.run([sys.executable, __file__, str(store.root), str(out), str(kill_at)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    assert launch(reference, -1).returncode == 0
    for kill_at in (6, 10):  # resumes at 4, then at 8
        assert launch(interrupted, kill_at).returncode == -signal.SIGKILL
    done = launch(interrupted, -1)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(interrupted, "ids.txt")) as f:
        steps = [int(line.split()[0]) for line in f]
    assert steps == [*range(6), *range(4, 10), *range(8, 12)]  # each attempt's updates
    assert _steps(interrupted) == _steps(reference)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], int(sys.argv[3]))

"""koochak-probe --dataset-shards is koochak-data's measure_dataset, found through an entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

from koochak.data.probe_shards import measure_dataset
from koochak.storage.probe import PROBE_MODES_GROUP
from koochak.storage.store import LocalStore


def test_koochak_data_registers_the_dataset_mode_of_the_storage_probe():
    (entry,) = [ep for ep in entry_points(group=PROBE_MODES_GROUP) if ep.name == "dataset_shards"]
    assert entry.value == "koochak.data.probe_shards:measure_dataset"
    assert entry.load() is measure_dataset


def test_dataset_mode_builds_the_shards_and_skips_more_readers_than_shards(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    dropped, notes = [], []
    rows = measure_dataset(
        store, shards=2, shard_bytes=16 << 10, readers=[3], drop_cache=dropped.append, notes=notes
    )
    assert [(row.metric, row.streams, row.unit) for row in rows] == [("dataset_build", 1, "B/s")]
    assert rows[0].note.startswith("2 shards of ") and rows[0].value > 0
    assert notes == ["dataset read with 3 readers skipped: only 2 shards to share"]
    assert dropped == []  # nothing was read, so no cache was dropped
    assert any(info.key == "dataset/index.json" for info in store.list("dataset/"))

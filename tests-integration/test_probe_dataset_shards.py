"""koochak-probe --dataset-shards: builds shards with koochak-data and reads them in spawned processes.

Lives here because it needs koochak-data, which sits above koochak-store.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("koochak.data.shards")

from koochak.storage.probe import main  # noqa: E402


@pytest.mark.slow
def test_dataset_mode_builds_reads_and_cleans_up(tmp_path, capsys):
    argv = [
        str(tmp_path),
        "--json",
        "--read-bytes",
        "64K",
        "--streams",
        "1",
        "--small-objects",
        "3",
        "--no-drop-caches",
        "--dataset-shards",
        "3",
        "--shard-bytes",
        "64K",
        "--readers",
        "1,2,4",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(row["metric"], row["streams"]): row for row in report["measurements"]}
    assert "3 shards" in rows[("dataset_build", 1)]["note"]
    for readers in (1, 2):
        assert rows[("dataset_read_cold", readers)]["value"] > 0
        assert rows[("dataset_read_warm", readers)]["value"] > 0
    assert ("dataset_read_cold", 4) not in rows
    assert any("4 readers skipped" in note for note in report["notes"])
    assert os.listdir(tmp_path) == []

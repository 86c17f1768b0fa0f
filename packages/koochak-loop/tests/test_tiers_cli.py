"""Tiers preflighted by koochak-train (issue 29, frictions 4-6): a fresh tiered run says nothing
about a "gone" tier; a replica with a typo, or in a bucket that does not exist, is refused at
start with exit 2 naming the key, before any training."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_cli  # noqa: E402
from koochak.loop.cli import main  # noqa: E402

project = test_cli.project  # the fixture: a user project in the working directory, its config


def _train(config, *overrides):
    return main(["--config", str(config), "train.max_steps=2", "train.ckpt_every=1",
                 "logging.stdout=false", *overrides, "--resume", "auto"])  # fmt: skip


def _gone(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "it is gone" in r.getMessage()]


def test_a_fresh_tiered_run_does_not_call_its_first_tier_gone(project, caplog):
    root, _, config = project
    tiers = [f"train.checkpoint_dir={root}/fast", f"train.checkpoint_replicas=[{root}/durable]"]
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        assert _train(config, *tiers) == 0
    assert _gone(caplog) == []
    assert (root / "durable" / "step000000002.pt").is_file()
    # A first tier that held this run's checkpoints and is missing now is gone, said once.
    shutil.rmtree(root / "fast")
    caplog.clear()
    from koochak.loop.checkpoint import resolve_auto_resume

    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        assert resolve_auto_resume([root / "fast", root / "durable"]).checkpoint["step"] == 2
    assert len(_gone(caplog)) == 1


def test_a_replica_whose_parent_does_not_exist_is_refused_unless_create(project, capsys):
    root, _, config = project
    typo = root / "no-such-dir" / "durable"
    assert _train(config, f"train.checkpoint_replicas=[{typo}]") == 2
    err = capsys.readouterr().err
    assert "train.checkpoint_replicas[0]" in err and "create: true" in err
    assert len(err.strip().splitlines()) == 1
    assert not typo.parent.exists() and not (root / "run").exists()  # nothing trained
    entry = f"train.checkpoint_replicas=[{{location: '{typo}', create: true}}]"
    assert _train(config, entry) == 0
    assert (typo / "step000000002.pt").is_file()


@pytest.fixture
def s3_stores(local_s3, tmp_path, monkeypatch):
    """A stores file with an S3 scheme ``gone27`` on a bucket that does not exist and one
    ``here27`` on the loopback server's bucket; the servers' credentials in the environment."""
    stores = tmp_path / "stores.yaml"
    endpoint = local_s3.env["KOOCHAK_S3_ENDPOINT"]
    bucket = local_s3.env["KOOCHAK_S3_NATIVE_BUCKET"]
    stores.write_text(
        "version: 1\nstores:\n"
        f"  gone27:\n    backend: s3\n    options: {{bucket: no-such-bucket-27, endpoint: "
        f"'{endpoint}'}}\n"
        f"  here27:\n    backend: s3\n    options: {{bucket: {bucket}, endpoint: '{endpoint}', "
        f"prefix: 'tests/tiers27/{os.getpid()}-{tmp_path.name}'}}\n"
    )
    monkeypatch.setenv("KOOCHAK_STORES", str(stores))
    for key, value in local_s3.credentials.items():
        monkeypatch.setenv(key, value)
    return stores


def test_a_replica_in_a_bucket_that_does_not_exist_is_refused_at_start(project, capsys, s3_stores):
    root, _, config = project
    assert _train(config, "train.checkpoint_replicas=[gone27://ckpt]") == 2
    err = capsys.readouterr().err
    assert "train.checkpoint_replicas[0]" in err and "bucket does not exist" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (root / "run" / "step000000000.pt").exists()  # refused before training
    # The same mistake in checkpoint_dir names its key too, without a "/step" suffix.
    assert _train(config, "train.checkpoint_dir=gone27://ckpt") == 2
    err = capsys.readouterr().err
    assert "train.checkpoint_dir" in err and "bucket does not exist" in err, err
    assert "/step" not in err and len(err.strip().splitlines()) == 1

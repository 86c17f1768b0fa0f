"""The digits quick start, run tiny through its own main and through koochak-train."""

from __future__ import annotations

import pathlib

import pytest
import torch
from koochak.loop.cli import main as cli_main
from koochak.loop.cli import run_with_one_line_errors
from koochak.loop.logging import read_csv_log

from examples.digits import main as digits

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_digits_main_runs_a_few_steps(tmp_path):
    ckpt = digits.main(
        [
            f"train.out_dir={tmp_path}",
            "train.max_steps=3",
            "train.eval_every=3",
            "optim.scheduler.warmup_steps=1",
            "logging.stdout=false",
        ]
    )
    assert ckpt["step"] == 3 and 0.0 <= ckpt["metrics"]["eval_acc"] <= 1.0
    assert (tmp_path / "log.csv").exists() and (tmp_path / "log.jsonl").exists()
    assert torch.load(tmp_path / "step000000003.pt", weights_only=True)["next_step"] == 3


def test_digits_entry_points_work_through_koochak_train(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = cli_main(
        [
            "--config",
            "examples/digits/config.yaml",
            f"train.out_dir={tmp_path}",
            "train.max_steps=2",
            "logging.stdout=false",
            "optim.scheduler.warmup_steps=1",
            "--resume",
            "none",
        ]
    )
    assert code == 0
    assert (tmp_path / "step000000002.pt").exists()


def test_digits_main_rerun_continues_from_its_checkpoint(tmp_path):
    args = [
        f"train.out_dir={tmp_path}",
        "train.log_every=1",
        "train.eval_every=0",
        "logging.stdout=false",
        "optim.scheduler.name=none",
    ]
    digits.main([*args, "train.max_steps=2"])
    ckpt = digits.main([*args, "train.max_steps=4"])
    assert ckpt["step"] == 4
    # Only updates 2 and 3 ran again; a fresh start would have logged 0 and 1 twice.
    rows = read_csv_log(tmp_path / "log.csv")
    assert [row["step"] for row in rows if row["event"] == "log"] == [0, 1, 2, 3]
    assert [row["step"] for row in rows if row["event"] == "attempt"] == [0, 2]  # one per run


def test_digits_typo_is_one_line_naming_the_key(capsys):
    assert run_with_one_line_errors("examples.digits", digits.main, ["train.max_step=3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'train.max_steps'?" in err[0]


def test_digits_dataset_resumes_at_the_same_batch():
    cfg = digits.load_config(digits.CONFIG)
    full = digits.train_dataset(cfg)
    expected = [next(full) for _ in range(40)][25:]
    resumed = digits.train_dataset(cfg, start_step=25)
    for (xa, ya), (xb, yb) in zip(expected, (next(resumed) for _ in range(15))):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_digits_split_is_stratified_and_disjoint():
    cfg = digits.load_config(digits.CONFIG)
    (xt, yt), (xv, yv) = digits._data(cfg)
    assert len(yt) + len(yv) == 1797
    assert set(yv.tolist()) == set(range(10))
    assert abs(len(yv) / 1797 - 0.2) < 0.01


@pytest.mark.slow
def test_digits_reaches_95_percent(tmp_path):
    ckpt = digits.main(
        [
            f"train.out_dir={tmp_path}",
            "train.max_steps=250",
            "train.eval_every=250",
            "optim.scheduler.T_max=250",
            "logging.stdout=false",
        ]
    )
    assert ckpt["metrics"]["eval_acc"] >= 0.95

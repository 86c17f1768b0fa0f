"""The MNIST example on tiny generated IDX files, through the real training_loop."""

import gzip
import importlib
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from koochak.loop.logging import read_csv_log, read_jsonl_log

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def mnist(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("examples.mnist.main")


def _write_idx(path: Path, array: np.ndarray, type_byte: int = 0x08) -> None:
    header = bytes([0, 0, type_byte, array.ndim]) + b"".join(
        struct.pack(">I", n) for n in array.shape
    )
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)


def _tiny_mnist(data_dir: Path, n_train: int = 96, n_test: int = 40, gz: bool = False) -> None:
    """Images whose brightest quadrant encodes the label class (mod 4), so a few steps learn."""
    rng = np.random.default_rng(0)
    data_dir.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 40, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            r, c = divmod(int(label) % 4, 2)
            images[i, r * 14 : r * 14 + 14, c * 14 : c * 14 + 14] += 200
        _write_idx(data_dir / f"{split}-images-idx3-ubyte{suffix}", images)
        _write_idx(data_dir / f"{split}-labels-idx1-ubyte{suffix}", labels)


def test_read_idx_round_trips_plain_and_gzip(mnist, tmp_path):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    for name in ("a-idx3-ubyte", "a-idx3-ubyte.gz"):
        _write_idx(tmp_path / name, array)
        np.testing.assert_array_equal(mnist.read_idx(tmp_path / name), array)
    floats = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    _write_idx(tmp_path / "f", floats, type_byte=0x0D)
    np.testing.assert_array_equal(mnist.read_idx(tmp_path / "f"), floats)


def test_read_idx_rejects_bad_files(mnist, tmp_path):
    (tmp_path / "junk").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="junk: not an IDX file"):
        mnist.read_idx(tmp_path / "junk")
    _write_idx(tmp_path / "short", np.zeros((4, 2), dtype=np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="short: IDX header promises 8 data bytes"):
        mnist.read_idx(tmp_path / "short")


def test_load_mnist_reads_torchvision_layout_and_gzip(mnist, tmp_path):
    _tiny_mnist(tmp_path / "MNIST" / "raw", n_train=10, n_test=6, gz=True)
    x, y = mnist.load_mnist(tmp_path, "train")
    assert x.shape == (10, 1, 28, 28) and y.shape == (10,) and str(y.dtype) == "torch.int64"


def test_missing_files_without_torchvision_name_it(mnist, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    with pytest.raises(ImportError, match="torchvision is not installed.*pip install torchvision"):
        mnist.load_mnist(tmp_path / "empty", "train")


@pytest.mark.slow
def test_mnist_example_trains_logs_evaluates_and_checkpoints(mnist, tmp_path, capsys):
    data_dir, out_dir = tmp_path / "data", tmp_path / "run"
    _tiny_mnist(data_dir)
    overrides = [
        f"data.data_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "data.batch_size=16",
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=3",
        "train.ckpt_every=3",
        "train.device=cpu",
        "train.progress_bar=false",
        "optim.scheduler.warmup_steps=2",
    ]
    checkpoint = mnist.main(["--config", str(REPO / "examples/mnist/config.yaml"), *overrides])

    assert checkpoint["step"] == 6 and checkpoint["next_step"] == 6
    assert (out_dir / "step000000006.pt").is_file()
    rows = [r for r in read_csv_log(out_dir / "log.csv") if r["event"] in ("log", "eval")]
    assert [(r["event"], r["step"]) for r in rows] == [
        ("log", 1),
        ("eval", 2),
        ("log", 3),
        ("log", 5),
        ("eval", 5),
    ]
    assert {"loss", "acc", "lr", "grad_norm"} <= rows[0]["metrics"].keys()
    assert {"eval_loss", "eval_acc"} == rows[1]["metrics"].keys()
    assert len(read_jsonl_log(out_dir / "log.jsonl")) == len(rows) + 2  # + attempt and end
    assert "log\tstep=5\tloss=" in capsys.readouterr().out


@pytest.mark.slow
def test_mnist_example_rerun_resumes_from_the_published_checkpoint(mnist, tmp_path):
    data_dir, out_dir = tmp_path / "data", tmp_path / "run"
    _tiny_mnist(data_dir)
    args = [
        "--config",
        str(REPO / "examples/mnist/config.yaml"),
        f"data.data_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "data.batch_size=16",
        "train.log_every=2",
        "train.eval_every=0",
        "train.ckpt_every=0",
        "train.device=cpu",
        "train.progress_bar=false",
        "logging.stdout=false",
        "optim.scheduler.warmup_steps=2",
    ]
    mnist.main([*args, "train.max_steps=6"])
    more = mnist.main([*args, "train.max_steps=8"])

    assert more["step"] == 8
    # Only the updates after the checkpoint ran again: a fresh start would re-log steps 1, 3, 5.
    rows = read_csv_log(out_dir / "log.csv")
    assert [r["step"] for r in rows if r["event"] == "log"] == [1, 3, 5, 7]


def test_resumed_run_sees_the_batches_of_an_uninterrupted_one(mnist, tmp_path, monkeypatch):
    """Stop at update 4, resume to 9 (crossing a pass: 96 images / 16 = 6 batches each) and
    get the same batches, in the same order, and bit-identical weights as one run to 9."""
    import torch

    _tiny_mnist(tmp_path / "data")
    seen: dict[str, list] = {}
    run = ["whole"]
    original = mnist.step_fn

    def recording(model, batch, ctx):
        seen.setdefault(run[0], []).append((ctx.step, batch[1].tolist()))
        return original(model, batch, ctx)

    monkeypatch.setattr(mnist, "step_fn", recording)

    def train(out: str, max_steps: int) -> dict:
        return mnist.main(
            [
                "--config",
                str(REPO / "examples/mnist/config.yaml"),
                f"data.data_dir={tmp_path / 'data'}",
                f"train.out_dir={tmp_path / out}",
                "data.batch_size=16",
                f"train.max_steps={max_steps}",
                "train.log_every=100",
                "train.eval_every=0",
                "train.ckpt_every=0",
                "train.device=cpu",
                "train.progress_bar=false",
                "logging.stdout=false",
                "optim.scheduler.name=none",
            ]
        )

    whole = train("whole", 9)
    run[0] = "split"
    train("split", 4)
    resumed = train("split", 9)

    assert [step for step, _ in seen["split"]] == list(range(9))
    assert seen["split"] == seen["whole"]
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_launcher_trains_two_gloo_ranks_under_torchrun(tmp_path):
    import os
    import subprocess

    import torch

    data_dir, out_dir = tmp_path / "data", tmp_path / "run"
    _tiny_mnist(data_dir)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        "-m",
        "examples.mnist.ddp_main",
        "--config",
        "examples/mnist/config.yaml",
        f"data.data_dir={data_dir}",
        f"train.out_dir={out_dir}",
        "data.batch_size=16",
        "train.max_steps=4",
        "train.log_every=2",
        "train.eval_every=4",
        "train.ckpt_every=0",
        "train.device=cpu",
        "train.progress_bar=false",
        "optim.scheduler.warmup_steps=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    checkpoint = torch.load(out_dir / "step000000004.pt", weights_only=True)
    assert checkpoint["config"]["train"]["ddp"] is True  # forced by the launcher
    # Rank 0 alone writes the logs: each event appears once, not once per rank.
    assert [(r["event"], r["step"]) for r in read_csv_log(out_dir / "log.csv")] == [
        ("attempt", 0),
        ("log", 1),
        ("log", 3),
        ("eval", 3),
        ("end", 4),
    ]
    assert result.stdout.count("log\tstep=3\t") == 1
    # Per-rank step timing: every log row carries the slowest and the fastest rank's step time.
    for row in read_csv_log(out_dir / "log.csv"):
        if row["event"] == "log":
            m = row["metrics"]
            assert m["step_time_s_max"] >= m["step_time_s"] >= m["step_time_s_min"] > 0

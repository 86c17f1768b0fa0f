"""The spec's koochak.utils.config helpers (get/as_dict) and rank-0-only unknown-key warnings."""

from __future__ import annotations

import json
import warnings

import pytest
from koochak.loop.config import ConfigError, as_dict, get, load_config
from omegaconf import DictConfig


def test_get_reads_dotted_paths_with_a_default():
    cfg = load_config(None, ["train.out_dir=runs/x", "logging.csv_path=${train.out_dir}/log.csv"])
    assert get(cfg, "train.max_steps") == 1000
    assert get(cfg, "logging.csv_path") == "runs/x/log.csv"  # interpolation resolved
    assert get(cfg, "optim.optimizer.betas.1") == 0.999
    assert isinstance(get(cfg, "optim.optimizer"), DictConfig)
    assert get(cfg, "train.nope", 7) == 7
    assert get(cfg, "nope.deeper.still", "d") == "d"
    assert get(cfg, "train.max_steps.deeper", "d") == "d"  # a scalar has no children
    assert get(cfg, "optim.optimizer.betas.5", "d") == "d"
    assert get(cfg, "train.checkpoint_dir", "d") is None  # present and null is not missing


def test_get_on_plain_dicts_as_a_checkpoint_holds_them():
    config = {"train": {"seed": 3, "tags": ["a", "b"]}, "data": None}
    assert get(config, "train.seed") == 3
    assert get(config, "train.tags.0") == "a"
    assert get(config, "data.batch_size", 8) == 8
    assert get(None, "train.seed", 1) == 1


@pytest.mark.parametrize("path", ["", "train.", ".seed", "a..b", 3])
def test_get_refuses_a_malformed_path(path):
    with pytest.raises(ConfigError, match="expected a dotted key path"):
        get({}, path)


def test_get_names_an_interpolation_that_cannot_resolve():
    cfg = load_config(None, ["data.root=/x"])
    cfg.data.broken = "${train.nope}"
    with pytest.raises(ConfigError, match=r"get\(cfg, 'data\.broken'\)"):
        get(cfg, "data.broken")


def test_as_dict_is_plain_and_resolved():
    cfg = load_config(None, ["train.out_dir=runs/y", "logging.jsonl_path=${train.out_dir}/l.jsonl"])
    plain = as_dict(cfg)
    assert type(plain) is dict and type(plain["train"]) is dict
    assert plain["logging"]["jsonl_path"] == "runs/y/l.jsonl"
    assert json.loads(json.dumps(plain)) == plain
    assert as_dict(cfg.train)["out_dir"] == "runs/y"
    assert as_dict({"a": {"b": 1}}) == {"a": {"b": 1}}
    assert as_dict(None) == {}


RELAXED = ["train.strict_config=false", "train.max_stpes=5"]


def test_unknown_key_warning_is_printed_on_rank_0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match="train.max_stpes"):
        load_config(None, RELAXED)


@pytest.mark.parametrize("rank", ["1", "7"])
def test_other_ranks_keep_the_keys_without_warning(monkeypatch, rank):
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, RELAXED)
    assert cfg.train.max_stpes == 5


def test_strict_mode_fails_on_every_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match="train.max_stpes"):
        load_config(None, ["train.max_stpes=5"])


_RANK_SCRIPT = """
import sys, warnings
import torch.distributed as dist
from koochak.loop.config import load_config

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    load_config(None, ["train.strict_config=false", "train.max_stpes=5"])
print("WARNED" if any("max_stpes" in str(w.message) for w in caught) else "QUIET")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_real_process_group_decides_the_rank():
    """Two gloo ranks; RANK=0 in both environments, so only the group's rank can silence rank 1."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "RANK": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["WARNED", "QUIET"]

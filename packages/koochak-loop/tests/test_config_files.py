"""Config files a person (or an accident) hands to load_config: every bad one is a one-line
ConfigError naming the file, at once, before OmegaConf or a validator sees the content."""

from __future__ import annotations

import pathlib

import pytest
from koochak.loop.config import ConfigError, load_config


def write(tmp_path, text: str | bytes, name: str = "cfg.yaml") -> pathlib.Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _alias_bomb(width: int, levels: int) -> str:
    """``levels`` lists of ``width`` aliases, each to the list before: width**levels leaves."""
    lines = ["  l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    for level in range(1, levels):
        aliases = ", ".join([f"*l{level - 1}"] * width)
        lines.append(f"  l{level}: &l{level} [{aliases}]")
    return "data:\n" + "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_naming_the_file(tmp_path):
    # 100 x 100 = 10,000 leaves: small enough that the old loader accepted it (slowly), so this
    # fails on it quickly; nine-wide and five deep took minutes there, and is refused here too.
    for width, levels in [(100, 2), (9, 5), (9, 8)]:
        path = write(tmp_path, _alias_bomb(width, levels))
        with pytest.raises(ConfigError, match=r"cfg\.yaml: the YAML expands to more than 10,000"):
            load_config(path)


def test_a_few_aliases_still_work(tmp_path):
    path = write(tmp_path, "data:\n  base: &b {size: 3}\n  again: *b\ntrain: {seed: 4}\n")
    assert load_config(path).data.again.size == 3


def test_a_duplicate_key_is_refused_naming_it(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 5\n  max_steps: 7\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: .*duplicate key 'max_steps'"):
        load_config(path)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a UTF-8 text file"),
        (b"train:\n  seed: 1\n\x00\x00", "not a text file"),
        (b"\xff\xfe\x00t\x00r", "not a UTF-8 text file"),
    ],
    ids=["png", "nul-bytes", "utf16"],
)
def test_a_binary_file_is_refused_naming_it(tmp_path, content, pattern):
    path = write(tmp_path, content, "model.yaml")
    with pytest.raises(ConfigError, match=rf"model\.yaml: {pattern}"):
        load_config(path)


def test_an_oversized_file_is_refused_before_it_is_parsed(tmp_path):
    path = write(tmp_path, "data:\n  blob: '" + "x" * (5 << 20) + "'\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: .* bytes is larger than"):
        load_config(path)


def test_a_directory_names_it(tmp_path):
    (tmp_path / "configs").mkdir()
    with pytest.raises(ConfigError, match=r"configs: is a directory, not a config file"):
        load_config(tmp_path / "configs")


def test_a_value_omegaconf_cannot_hold_names_the_file(tmp_path):
    path = write(tmp_path, "data:\n  when: 2024-01-01\n  nested: {1: x}\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: "):
        load_config(path)


@pytest.mark.parametrize("device", ["tpu9", "cuda:x", "gpu", ""])
def test_an_unknown_device_is_a_config_error_naming_the_accepted_values(device):
    with pytest.raises(
        ConfigError, match=r"train\.device: expected one of auto\|cpu\|cuda\|cuda:N\|mps"
    ):
        load_config(None, [f"train.device={device!r}" if device else "train.device=''"])


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:3", "mps"])
def test_accepted_devices_load(device):
    assert load_config(None, [f"train.device={device}"]).train.device == device

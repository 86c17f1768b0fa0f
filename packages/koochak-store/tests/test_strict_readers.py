"""The shared strict readers: every Koochak format and config file goes through these."""

from __future__ import annotations

import time

import pytest
from koochak.storage.strict_json import is_exact_int, loads_strict, require_version
from koochak.storage.strict_yaml import load_yaml_file, loads_yaml


def _alias_bomb(levels: int, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ",".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [5, 8, 12])
def test_alias_bomb_is_refused_at_once(levels):
    doc = _alias_bomb(levels)
    assert len(doc) < 2048
    started = time.process_time()
    with pytest.raises(ValueError, match=r"bomb\.yaml: the YAML expands to more than"):
        loads_yaml(doc, "bomb.yaml")
    # Not a speed assertion on the machine: the bound is what makes this terminate at all.
    assert time.process_time() - started < 30


def test_small_aliases_and_merge_keys_still_work():
    doc = "base: &b {lr: 0.1, wd: 0.0}\nrun:\n  <<: *b\n  wd: 0.01\nlist: [*b, *b]\n"
    data = loads_yaml(doc, "c.yaml")
    assert data["run"] == {"lr": 0.1, "wd": 0.01}
    assert data["list"] == [{"lr": 0.1, "wd": 0.0}] * 2


def test_duplicate_key_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"c\.yaml: .*duplicate key 'lr'"):
        loads_yaml("train:\n  lr: 1\n  lr: 2\n", "c.yaml")


def test_binary_and_nul_files_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04\x80\x81\xff garbage")
    with pytest.raises(ValueError, match=r"model\.pt: not a UTF-8 text file"):
        load_yaml_file(path)
    with pytest.raises(ValueError, match=r"x\.yaml: not a text file"):
        loads_yaml("a: 1\x00\n", "x.yaml")


def test_oversized_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"a: 1\n" + b"#" * 5000)
    with pytest.raises(ValueError, match=r"big\.yaml: 5,005 bytes is larger than the 4,096-byte"):
        load_yaml_file(path, max_bytes=4096)


def test_unsafe_tags_are_refused():
    with pytest.raises(ValueError, match="not valid YAML"):
        loads_yaml("a: !!python/object/apply:os.system ['true']\n", "evil.yaml")


def test_errors_are_one_line():
    with pytest.raises(ValueError) as info:
        loads_yaml("a: [\n", "c.yaml")
    assert "\n" not in str(info.value)


def test_json_duplicate_field_and_constants_are_refused():
    with pytest.raises(ValueError, match=r"m\.json: .*'version' appears twice"):
        loads_strict(b'{"version": 1, "version": 1}', "m.json")
    with pytest.raises(ValueError, match=r"m\.json: .*NaN is not valid JSON"):
        loads_strict('{"x": NaN}', "m.json")
    with pytest.raises(ValueError, match=r"m\.json: JSON nested too deeply"):
        loads_strict("[" * 100_000 + "]" * 100_000, "m.json")


@pytest.mark.parametrize("value", [True, 1.0, "1", None, [1]])
def test_version_must_be_the_exact_integer(value):
    with pytest.raises(ValueError, match=r"m\.json: field 'version' must be the integer 1"):
        require_version({"version": value}, "m.json", 1)


def test_version_checks():
    assert require_version({"version": 1}, "m.json", 1) == 1
    assert require_version({"v": 2}, "m.json", (1, 2), field="v") == 2
    with pytest.raises(ValueError, match=r"version=3; this Koochak reads version 1"):
        require_version({"version": 3}, "m.json", 1)
    with pytest.raises(ValueError, match=r"field 'version' is missing"):
        require_version({}, "m.json", 1)
    assert is_exact_int(0) and not is_exact_int(False) and not is_exact_int(0.0)


def test_check_fields_names_the_first_unknown_then_the_first_missing_field():
    from koochak.storage.strict_json import check_fields

    doc = {"a": 1, "b": 2}
    assert check_fields(doc, "x.json", {"a"}, {"b"}) is doc
    with pytest.raises(ValueError, match=r"^x.json: unknown field 'env.z' \(expected a, b\)$"):
        check_fields({"a": 1, "z": 0}, "x.json", {"a"}, {"b"}, prefix="env.")
    with pytest.raises(KeyError, match="x.json: missing field 'a'"):
        check_fields({"b": 2}, "x.json", {"a"}, {"b"}, error=KeyError)
    with pytest.raises(ValueError, match="x.json: expected a JSON object, got list"):
        check_fields([], "x.json", {"a"})

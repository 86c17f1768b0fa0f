"""prepare_run, the launch manifest and write-once staging."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
from koochak.jobs import ConfigPatch, DeclaredOutput, load_environment_profile, prepare_run
from koochak.jobs.manifest import parse_manifest

CONFIG = """\
train:
  max_steps: 10
  out_dir: runs/somewhere
data:
  max_length: 64
  nested: {a: 1, b: 2}
logging:
  csv_path: ${train.out_dir}/log.csv
"""


@pytest.fixture
def profile(tmp_path, kit):
    path = kit.basic_profile(
        tmp_path,
        'CACHE: "{run_dir}/cache"\n',
        "  secrets: [TRACKING_TOKEN]\n",
    )
    return load_environment_profile(path)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(CONFIG)
    return path


def prepare(tmp_path, profile, config, **kwargs):
    args = dict(
        name="smoke-len128",
        profile=profile,
        python_args=["-m", "pkg.train", "--config", "{config}", "--out", "{run_dir}/x"],
        cwd=str(tmp_path),
        run_dir=str(tmp_path / "runs" / "r1") + "/",
        base_config=config,
        patches=[ConfigPatch("data.max_length", 128), ConfigPatch("data.nested", {"c": 3})],
        outputs=[DeclaredOutput("dataset/tokens", "{run_dir}/tokens.bin")],
    )
    args.update(kwargs)
    return prepare_run(**args)


def test_prepare_is_pure_and_deterministic(tmp_path, profile, config):
    first = prepare(tmp_path, profile, config)
    second = prepare(tmp_path, profile, config)
    assert not (tmp_path / "runs").exists()  # nothing written
    assert first.manifest_sha256 == second.manifest_sha256
    assert first.artifacts == second.artifacts
    run_dir = str(tmp_path / "runs" / "r1")
    assert first.run_dir == run_dir  # trailing slash stripped
    assert first.runner_argv == (
        sys.executable,
        "-I",
        "-m",
        "koochak.jobs.runner",
        first.manifest_path,
        first.manifest_sha256,
    )
    assert first.manifest_path == f"{run_dir}/launch.json"
    assert first.artifacts[-1].path == first.manifest_path  # the manifest is last
    with pytest.raises(AttributeError):
        first.run_dir = "/elsewhere"  # type: ignore[misc]


def test_config_is_materialised_with_patches_out_dir_and_resolved_interpolations(
    tmp_path, profile, config
):
    prepared = prepare(tmp_path, profile, config)
    text = prepared.artifacts[0].content.decode()
    run_dir = prepared.run_dir
    assert f"out_dir: {run_dir}" in text
    assert "max_length: 128" in text
    assert f"csv_path: {run_dir}/log.csv" in text  # interpolation resolved against the pin
    assert "c: 3" in text and "a: 1" in text  # merge=True keeps the other keys
    replaced = prepare(
        tmp_path, profile, config, patches=[ConfigPatch("data.nested", {"c": 3}, merge=False)]
    )
    assert "a: 1" not in replaced.artifacts[0].content.decode()
    assert replaced.manifest_sha256 != prepared.manifest_sha256


def test_manifest_pins_environment_argv_config_and_outputs_without_secret_values(
    tmp_path, profile, config, monkeypatch
):
    monkeypatch.setenv("TRACKING_TOKEN", "value-that-must-not-leak")
    prepared = prepare(tmp_path, profile, config)
    doc = parse_manifest(prepared.artifacts[-1].content, "m")
    assert doc["argv"] == [
        sys.executable,
        "-m",
        "pkg.train",
        "--config",
        prepared.config_path,
        "--out",
        f"{prepared.run_dir}/x",
    ]
    assert doc["config"] == {"path": prepared.config_path, "sha256": prepared.config_sha256}
    assert doc["environment"]["set"]["CACHE"] == f"{prepared.run_dir}/cache"
    assert doc["environment"]["secrets"] == ["TRACKING_TOKEN"]
    assert doc["environment"]["profile_sha256"] == profile.sha256
    assert doc["outputs"][0].path == f"{prepared.run_dir}/tokens.bin"
    raw = b"".join(a.content for a in prepared.artifacts)
    assert b"value-that-must-not-leak" not in raw
    assert not re.search(rb"\d{4}-\d\d-\d\dT\d\d:", raw)  # no timestamps
    other = prepare(tmp_path, profile, config, python_args=["-m", "pkg.train", "--other"])
    assert other.manifest_sha256 != prepared.manifest_sha256


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"name": "bad name"}, "name="),
        ({"cwd": "relative"}, "cwd="),
        ({"run_dir": "runs/r1"}, "run_dir="),
        ({"python_args": "-m pkg"}, "not one string"),
        ({"python_args": []}, "at least one"),
        ({"python_args": ["ok", ""]}, "non-empty string"),
        ({"base_config": None, "patches": []}, "{config} requires base_config"),
        ({"patches": ["data.x=1"]}, "not a ConfigPatch"),
        ({"outputs": [DeclaredOutput("a/b", "/x"), DeclaredOutput("a/b", "/y")]}, "repeat"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, profile, config, kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("{", r"\{").replace("}", r"\}")):
        prepare(tmp_path, profile, config, **kwargs)


def test_config_patch_and_declared_output_validate_themselves():
    with pytest.raises(ValueError, match="path"):
        ConfigPatch("", 1)
    with pytest.raises(ValueError, match="resolver"):
        ConfigPatch("a", "${oc.env:SECRET}")
    with pytest.raises(ValueError, match="plain YAML"):
        ConfigPatch("a", object())
    with pytest.raises(ValueError, match="kind"):
        DeclaredOutput("a/b", "/x", kind="link")
    with pytest.raises(ValueError, match="<kind>/<name>"):
        DeclaredOutput("nokind", "/x")
    with pytest.raises(ValueError, match="absolute"):
        DeclaredOutput("a/b", "relative")


def test_resolver_interpolations_in_the_base_config_are_refused(tmp_path, profile):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  token: ${oc.env:TRACKING_TOKEN}\n")
    with pytest.raises(ValueError, match="resolver"):
        prepare(tmp_path, profile, path, patches=[])


def test_staging_writes_read_only_files_and_reruns_are_no_ops(tmp_path, profile, config):
    prepared = prepare(tmp_path, profile, config)
    written = prepared.stage()
    assert written == [prepared.config_path, prepared.manifest_path]
    for path in written:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o444
    with open(prepared.manifest_path, "rb") as f:
        assert f.read() == prepared.artifacts[-1].content
    assert json.loads(Path(prepared.manifest_path).read_text())["version"] == 1
    os.chmod(prepared.manifest_path, 0o644)
    assert prepared.stage() == []  # identical bytes: nothing written ...
    assert stat.S_IMODE(os.stat(prepared.manifest_path).st_mode) == 0o444  # ... mode re-hardened
    assert not [n for n in os.listdir(prepared.run_dir) if n.startswith(".koochak-tmp-")]


def test_staging_refuses_different_content_and_symlinks(tmp_path, profile, config):
    prepared = prepare(tmp_path, profile, config)
    prepared.stage()
    changed = prepare(tmp_path, profile, config, patches=[ConfigPatch("data.max_length", 256)])
    with pytest.raises(FileExistsError, match="different content"):
        changed.stage()
    with open(prepared.manifest_path, "rb") as f:
        assert f.read() == prepared.artifacts[-1].content  # untouched

    other = prepare(tmp_path, profile, config, run_dir=str(tmp_path / "runs" / "r2"))
    os.makedirs(other.run_dir)
    os.symlink(tmp_path / "elsewhere", other.config_path)  # dangling
    with pytest.raises(FileExistsError, match="symlink"):
        other.stage()
    assert not os.path.exists(other.manifest_path)  # the manifest never lands before its config
    os.unlink(other.config_path)
    target = tmp_path / "target.yaml"
    target.write_bytes(other.artifacts[0].content)
    os.symlink(target, other.config_path)  # even one pointing at identical bytes
    with pytest.raises(FileExistsError, match="symlink"):
        other.stage()


def test_concurrent_stagers_of_the_same_run_all_succeed(tmp_path, profile, config):
    from concurrent.futures import ThreadPoolExecutor

    for attempt in range(10):  # fresh run directories: every race starts from nothing
        prepared = prepare(tmp_path, profile, config, run_dir=str(tmp_path / f"race{attempt}"))
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _, run=prepared: run.stage(), range(16)))
        assert sum(len(r) for r in results) == 2  # each file written exactly once
        with open(prepared.manifest_path, "rb") as f:
            assert f.read() == prepared.artifacts[-1].content


def test_a_separate_launch_dir_holds_the_files_but_the_run_still_writes_to_run_dir(
    tmp_path, profile, config
):
    prepared = prepare(tmp_path, profile, config, launch_dir=str(tmp_path / "launch"))
    assert prepared.manifest_path == str(tmp_path / "launch" / "launch.json")
    assert prepared.config_path == str(tmp_path / "launch" / "config.yaml")
    assert prepared.preflight_path == str(tmp_path / "launch" / "preflight.json")
    assert f"out_dir: {prepared.run_dir}" in prepared.artifacts[0].content.decode()
    assert prepared.manifest["environment"]["set"]["CACHE"] == f"{prepared.run_dir}/cache"

"""Environment profiles: the strict schema, placeholders, digests and every refusal."""

from __future__ import annotations

import textwrap

import pytest
from koochak.jobs import load_environment_profile
from koochak.jobs.profile import RUNTIME_OWNED

GOOD = """\
version: 1
id: project-gpu-v1
python: /opt/env/bin/python
environment:
  set:
    PATH: /opt/tool/bin:/opt/env/bin:/usr/bin:/bin
    CC: /opt/tool/bin/gcc
    CXX: /opt/tool/bin/g++
    TRITON_CACHE_DIR: "{run_dir}/triton-cache"
  secrets: [TRACKING_TOKEN]
  create_directories: ["{run_dir}/triton-cache"]
requirements:
  executables: [/opt/tool/bin/gcc, /opt/tool/bin/g++]
  files: ["{cwd}/data/train.bin"]
  packages: {torch: "2.8.0", triton: "3.4.0"}
preflight: [c_compiler, cuda, torch_compile]
"""


def load(tmp_path, text, name="profile.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return load_environment_profile(path)


def test_the_spec_example_loads_with_every_field(tmp_path):
    profile = load(tmp_path, GOOD)
    assert profile.profile_id == "project-gpu-v1"
    assert profile.variables["CC"] == "/opt/tool/bin/gcc"
    assert profile.secrets == ("TRACKING_TOKEN",)
    assert dict(profile.packages) == {"torch": "2.8.0", "triton": "3.4.0"}
    assert profile.preflight == ("c_compiler", "cuda", "torch_compile")
    with pytest.raises(TypeError):
        profile.variables["PATH"] = "/x"  # read-only mapping


def test_digest_is_stable_and_ignores_layout_but_not_content(tmp_path):
    first = load(tmp_path, GOOD, "a.yaml")
    again = load(tmp_path, GOOD, "b.yaml")
    reordered = load(
        tmp_path,
        "# a comment\npreflight: [c_compiler, cuda, torch_compile]\n"
        + GOOD.replace("preflight: [c_compiler, cuda, torch_compile]\n", ""),
        "c.yaml",
    )
    changed = load(tmp_path, GOOD.replace('"3.4.0"', '"3.4.1"'), "d.yaml")
    assert first.sha256 == again.sha256 == reordered.sha256
    assert len(first.sha256) == 64
    assert changed.sha256 != first.sha256


def test_resolve_substitutes_placeholders_and_keeps_secret_names_only(tmp_path):
    env = load(tmp_path, GOOD).resolve(cwd="/srv/project", run_dir="/runs/r1")
    assert env["set"]["TRITON_CACHE_DIR"] == "/runs/r1/triton-cache"
    assert env["create_directories"] == ["/runs/r1/triton-cache"]
    assert env["files"] == ["/srv/project/data/train.bin"]
    assert env["secrets"] == ["TRACKING_TOKEN"]
    assert env["inherit"] == list(RUNTIME_OWNED)
    with pytest.raises(ValueError, match="cwd"):
        load(tmp_path, GOOD).resolve(cwd="relative", run_dir="/runs/r1")


def test_literal_braces_are_written_doubled(tmp_path):
    text = GOOD.replace('TRITON_CACHE_DIR: "{run_dir}/triton-cache"', 'FMT: "{{x}}-{run_dir}"')
    env = load(tmp_path, text).resolve(cwd="/c", run_dir="/r")
    assert env["set"]["FMT"] == "{x}-/r"


REFUSALS = [
    ("unknown top-level field", ("preflight:", "unknown: 1\npreflight:"), "field 'unknown'"),
    (
        "environment.inherit",
        ("  secrets:", "  inherit: [PATH]\n  secrets:"),
        "'environment.inherit'",
    ),
    (
        "environment.preserve",
        ("  secrets:", "  preserve: [X]\n  secrets:"),
        "'environment.preserve'",
    ),
    ("requirements.extra", ("  files:", "  extra: []\n  files:"), "'requirements.extra'"),
    ("version 2", ("version: 1", "version: 2"), "field 'version'"),
    ("version true", ("version: 1", "version: true"), "field 'version'"),
    ("missing id", ("id: project-gpu-v1\n", ""), "field 'id' is required"),
    ("bad id", ("id: project-gpu-v1", "id: -bad id"), "field 'id'"),
    ("relative python", ("python: /opt/env/bin/python", "python: bin/python"), "field 'python'"),
    ("interpolation", ('"{run_dir}/triton-cache"\n', '"${oc.env:HOME}/cache"\n'), "interpolation"),
    ("plain interpolation", ("/opt/tool/bin/gcc\n    CXX", "${x}\n    CXX"), "interpolation"),
    (
        "missing PATH",
        ("    PATH: /opt/tool/bin:/opt/env/bin:/usr/bin:/bin\n", ""),
        "PATH' is required",
    ),
    ("relative PATH entry", ("PATH: /opt/tool/bin:", "PATH: bin:"), "'environment.set.PATH'"),
    (
        "empty PATH entry",
        ("PATH: /opt/tool/bin:", "PATH: /opt/tool/bin::"),
        "'environment.set.PATH'",
    ),
    ("relative CC", ("CC: /opt/tool/bin/gcc", "CC: gcc"), "'environment.set.CC'"),
    (
        "non-string value",
        ('TRITON_CACHE_DIR: "{run_dir}/triton-cache"', "OMP_NUM_THREADS: 4"),
        "quote it",
    ),
    (
        "bad variable name",
        ('TRITON_CACHE_DIR: "{run_dir}', '"BAD-NAME": "{run_dir}'),
        "'environment.set.BAD-NAME'",
    ),
    (
        "unknown placeholder",
        ('"{run_dir}/triton-cache"\n', '"{home}/x"\n'),
        "unsupported placeholder",
    ),
    ("secret also set", ("secrets: [TRACKING_TOKEN]", "secrets: [CC]"), "also in environment.set"),
    (
        "runtime-owned secret",
        ("secrets: [TRACKING_TOKEN]", "secrets: [SCRUFFY_JOB_ID]"),
        "secrets cannot override runtime-owned",
    ),
    (
        "wildcard secret",
        ("secrets: [TRACKING_TOKEN]", "secrets: [TOKEN_*]"),
        "exact environment variable name",
    ),
    ("repeated secret", ("secrets: [TRACKING_TOKEN]", "secrets: [A, A]"), "appears twice"),
    (
        "relative directory",
        ('create_directories: ["{run_dir}/triton-cache"]', "create_directories: [cache]"),
        "'environment.create_directories'",
    ),
    (
        "relative executable",
        ("executables: [/opt/tool/bin/gcc,", "executables: [gcc,"),
        "'requirements.executables'",
    ),
    (
        "relative file",
        ('files: ["{cwd}/data/train.bin"]', "files: [data.bin]"),
        "'requirements.files'",
    ),
    ("float version", ('torch: "2.8.0"', "torch: 2.8"), "quote it"),
    (
        "bad package name",
        ('torch: "2.8.0"', '"not a module": "1"'),
        "not an importable module name",
    ),
    ("empty version", ('torch: "2.8.0"', 'torch: " "'), "'requirements.packages.torch'"),
    (
        "unknown check",
        ("[c_compiler, cuda, torch_compile]", "[c_compiler, gpu]"),
        "unknown check 'gpu'",
    ),
    ("string list", ("secrets: [TRACKING_TOKEN]", "secrets: TRACKING_TOKEN"), "expected a list"),
    ("empty string in list", ("secrets: [TRACKING_TOKEN]", 'secrets: [""]'), "non-empty strings"),
    (
        "c_compiler without CC",
        ("    CC: /opt/tool/bin/gcc\n", ""),
        "c_compiler requires an explicit CC",
    ),
    (
        "torch_compile without CXX",
        ("    CXX: /opt/tool/bin/g++\n", ""),
        "torch_compile requires explicit CC and CXX",
    ),
    (
        "duplicate key",
        ("    CC: /opt/tool/bin/gcc\n", "    CC: /a/gcc\n    CC: /b/gcc\n"),
        "duplicate key",
    ),
    ("missing python", ("python: /opt/env/bin/python\n", ""), "field 'python' is required"),
    ("missing version", ("version: 1\n", ""), "field 'version' is required"),
    (
        "packages not a mapping",
        ('packages: {torch: "2.8.0", triton: "3.4.0"}', "packages: [torch]"),
        "'requirements.packages'",
    ),
    (
        "preflight not a list",
        ("preflight: [c_compiler, cuda, torch_compile]", "preflight: cuda"),
        "field 'preflight'",
    ),
    ("repeated check", ("[c_compiler, cuda, torch_compile]", "[cuda, cuda]"), "appears twice"),
]
RUNTIME = [
    "HOME",
    "SLURM_JOB_ID",
    "SCRUFFY_ROOT",
    "CUDA_VISIBLE_DEVICES",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "GROUP_RANK",
    "LC_ALL",
    "TMPDIR",
]


@pytest.mark.parametrize("label,edit,expected", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_bad_field_is_one_value_error_naming_file_and_field(tmp_path, label, edit, expected):
    old, new = edit
    assert old in GOOD, label
    with pytest.raises(ValueError) as info:
        load(tmp_path, GOOD.replace(old, new, 1))
    message = str(info.value)
    assert message.startswith(str(tmp_path / "profile.yaml")), message
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("name", RUNTIME)
def test_runtime_owned_names_cannot_be_set(tmp_path, name):
    text = GOOD.replace(
        "    CC: /opt/tool/bin/gcc\n", f"    CC: /opt/tool/bin/gcc\n    {name}: x\n"
    )
    with pytest.raises(ValueError, match=f"cannot override runtime-owned {name}"):
        load(tmp_path, text)


def test_a_profile_that_is_not_a_mapping_or_has_an_empty_section_is_refused(tmp_path):
    for text in ("- a\n- b\n", "", "just text\n"):
        with pytest.raises(ValueError, match="must be a YAML mapping"):
            load(tmp_path, text)
    head = "version: 1\nid: a\npython: /p\n"
    with pytest.raises(ValueError, match="field 'environment' must be a mapping"):
        load(tmp_path, head + "environment: [a]\n")
    with pytest.raises(ValueError, match="field 'requirements' is empty"):
        load(tmp_path, head + "environment:\n  set:\n    PATH: /bin\nrequirements:\n")


def test_binary_and_missing_files_are_refused_by_name(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match="bin.yaml"):
        load_environment_profile(path)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_environment_profile(tmp_path / "nope.yaml")

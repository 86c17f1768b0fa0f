"""The runner as a real ``python -I`` subprocess: digests, the clean environment, requirements,
one-line failures that never start user code, preflight.json and the exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest

START = """\
import json, os, sys
open({marker!r}, "w").write("started")
"""


def env_dump_workload(kit, tmp_path, marker):
    return kit.workload(
        tmp_path,
        START.format(marker=str(marker))
        + "json.dump(dict(os.environ), open(sys.argv[1] if sys.argv[1:] else os.devnull, 'w'))\n"
        + "print('workload ran')\n",
    )


def test_clean_environment_is_rebuilt_and_user_code_runs_last(kit, tmp_path, marker):
    profile = kit.basic_profile(
        tmp_path,
        'CACHE: "{run_dir}/cache"\nNCCL_DEBUG: WARN\n',
        'secrets: [TRACKING_TOKEN]\ncreate_directories: ["{run_dir}/cache"]\n',
    )
    script = env_dump_workload(kit, tmp_path, marker)
    dump = tmp_path / "env.json"
    prepared = kit.staged(tmp_path, profile, script, python_args=[str(script), str(dump)])
    ambient = dict(os.environ)
    ambient.update(
        PYTHONPATH="/somewhere/stale",
        NCCL_SOCKET_IFNAME="eth9",
        NCCL_DEBUG="INFO",
        CC="/ambient/cc",
        SLURM_JOB_ID="4242",
        SCRUFFY_JOB_ID="job-1",
        CUDA_VISIBLE_DEVICES="3",
        RANK="0",
        TRACKING_TOKEN="tok-123",
        UNRELATED="x",
    )
    done = kit.run_runner(prepared, env=ambient)
    assert done.returncode == 0, done.stderr
    assert "workload ran" in done.stdout
    env = json.loads(dump.read_text())
    assert env["PATH"] == kit.PATH
    assert env["CACHE"] == f"{prepared.run_dir}/cache"
    assert os.path.isdir(f"{prepared.run_dir}/cache")
    assert env["NCCL_DEBUG"] == "WARN"  # the profile's, not the ambient one
    for dropped in ("PYTHONPATH", "NCCL_SOCKET_IFNAME", "CC", "UNRELATED"):
        assert dropped not in env
    for kept, value in (
        ("SLURM_JOB_ID", "4242"),
        ("SCRUFFY_JOB_ID", "job-1"),
        ("CUDA_VISIBLE_DEVICES", "3"),
        ("RANK", "0"),
        ("TRACKING_TOKEN", "tok-123"),
    ):
        assert env[kept] == value
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "completed" and record["child_returncode"] == 0
    assert record["manifest_sha256"] == prepared.manifest_sha256
    assert record["profile_sha256"] == prepared.profile.sha256
    assert len(record["environment_sha256"]) == 64
    assert stat.S_IMODE(os.stat(prepared.preflight_path).st_mode) == 0o444


def test_secret_values_are_never_written_anywhere(kit, tmp_path, marker):
    secret = "s3cr3t-Zq9-value-never-on-disk"
    profile = kit.basic_profile(tmp_path, environment="secrets: [TRACKING_TOKEN]\n")
    script = kit.workload(
        tmp_path,
        START.format(marker=str(marker))
        + "import hashlib\n"
        + "seen = hashlib.sha256(os.environ['TRACKING_TOKEN'].encode()).hexdigest()\n"
        + f"assert seen == {hashlib.sha256(secret.encode()).hexdigest()!r}\nprint('secret seen')\n",
    )
    prepared = kit.staged(tmp_path, profile, script)
    env = dict(os.environ, TRACKING_TOKEN=secret)
    done = kit.run_runner(prepared, env=env)
    assert done.returncode == 0, done.stderr
    assert "secret seen" in done.stdout
    done = kit.run_runner(prepared, "--preflight-only", env=env)
    assert done.returncode == 0
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert prepared.preflight_path in written and prepared.manifest_path in written
    for path in written:
        with open(path, "rb") as f:
            assert secret.encode() not in f.read(), path
    assert secret not in done.stdout + done.stderr


def test_a_missing_secret_fails_before_user_code_naming_it(kit, tmp_path, marker):
    profile = kit.basic_profile(tmp_path, environment="secrets: [TRACKING_TOKEN, OTHER]\n")
    prepared = kit.staged(tmp_path, profile, env_dump_workload(kit, tmp_path, marker))
    env = {k: v for k, v in os.environ.items() if k not in ("TRACKING_TOKEN", "OTHER")}
    env["OTHER"] = "present"
    done = kit.run_runner(prepared, env=env)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["kind"] == "environment_preflight_failed" and line["check"] == "secrets"
    assert "TRACKING_TOKEN" in line["error"] and "present" not in done.stderr
    assert not marker.exists()
    assert json.loads(Path(prepared.preflight_path).read_text())["state"] == "failed"


def test_tampered_manifest_or_config_never_starts_user_code(kit, tmp_path, marker):
    profile = kit.basic_profile(tmp_path)
    config = tmp_path / "train.yaml"
    config.write_text("train:\n  max_steps: 1\n")
    script = env_dump_workload(kit, tmp_path, marker)
    prepared = kit.staged(
        tmp_path, profile, script, base_config=config, python_args=[str(script), "{config}"]
    )
    wrong = "0" * 64
    argv = [*prepared.runner_argv[:5], wrong]
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "manifest" and "digest differs" in line["error"]
    assert not os.path.exists(prepared.preflight_path)  # an untrusted manifest names no file

    os.chmod(prepared.config_path, 0o644)
    with open(prepared.config_path, "a") as f:
        f.write("# edited\n")
    done = kit.run_runner(prepared)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "config" and "config digest differs" in line["error"]
    assert not marker.exists()


def test_wrong_package_version_and_missing_executable_fail_by_name(kit, tmp_path, marker):
    script = env_dump_workload(kit, tmp_path, marker)
    profile = kit.basic_profile(
        tmp_path, tail='requirements:\n  packages: {yaml: "0.0.1", json: "*"}\n'
    )
    done = kit.run_runner(kit.staged(tmp_path, profile, script))
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "requirements.packages"
    assert "yaml" in line["error"] and "0.0.1" in line["error"]

    profile = kit.basic_profile(
        tmp_path, tail="requirements:\n  packages: {no_such_module_x: '*'}\n", name="q.yaml"
    )
    done = kit.run_runner(kit.staged(tmp_path, profile, script, run_dir=str(tmp_path / "r2")))
    assert "no_such_module_x not importable" in kit.failure(done.stderr)["error"]

    profile = kit.basic_profile(
        tmp_path, tail="requirements:\n  executables: [/no/such/gcc]\n", name="e.yaml"
    )
    done = kit.run_runner(kit.staged(tmp_path, profile, script, run_dir=str(tmp_path / "r3")))
    line = kit.failure(done.stderr)
    assert line["check"] == "requirements.executables" and "/no/such/gcc" in line["error"]
    assert not marker.exists()


def test_package_versions_are_the_ones_the_workload_imports(kit, tmp_path, marker):
    lib = tmp_path / "lib"
    (lib / "mypkg").mkdir(parents=True)
    (lib / "mypkg" / "__init__.py").write_text("__version__ = '1.2.3+local'\n")
    script = env_dump_workload(kit, tmp_path, marker)
    profile = kit.basic_profile(
        tmp_path, f"PYTHONPATH: {lib}\n", tail="requirements:\n  packages: {mypkg: '1.2.3'}\n"
    )
    prepared = kit.staged(
        tmp_path, profile, script, python_args=[str(script), str(tmp_path / "e.json")]
    )
    done = kit.run_runner(prepared)
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["observed"]["package:mypkg"] == "1.2.3+local"


def test_required_file_missing_fails_at_once(kit, tmp_path, marker):
    script = env_dump_workload(kit, tmp_path, marker)
    profile = kit.basic_profile(tmp_path, tail='requirements:\n  files: ["{cwd}/data.bin"]\n')
    prepared = kit.staged(tmp_path, profile, script)
    done = kit.run_runner(prepared, "--file-wait-seconds", "600")
    line = kit.failure(done.stderr)
    assert line["check"] == "requirements.files" and f"{tmp_path}/data.bin" in line["error"]
    assert not marker.exists()
    (tmp_path / "data.bin").write_bytes(b"x")
    assert kit.run_runner(prepared).returncode == 0


def test_usage_errors_exit_64_with_one_line(kit, tmp_path):
    import subprocess

    for args in ([], ["only-one"], ["m.json", "not-a-digest"], ["--bogus", "m", "0" * 64]):
        done = subprocess.run(
            [sys.executable, "-I", "-m", "koochak.jobs.runner", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 64, args
        assert len(done.stderr.strip().splitlines()) == 1 and "usage:" in done.stderr
        assert "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "-I", "-m", "koochak.jobs.runner", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "usage:" in done.stdout and "Exit codes" in done.stdout


def test_child_exit_codes_pass_through(kit, tmp_path):
    profile = kit.basic_profile(tmp_path)
    script = kit.workload(tmp_path, "import sys\nsys.exit(int(sys.argv[1]))\n")
    for code, expected in ((3, 3), (75, 75), (76, 76)):
        prepared = kit.staged(
            tmp_path,
            profile,
            script,
            python_args=[str(script), str(code)],
            run_dir=str(tmp_path / f"r{code}"),
        )
        done = kit.run_runner(prepared)
        assert done.returncode == expected
        record = json.loads(Path(prepared.preflight_path).read_text())
        assert record["state"] == "failed" and record["child_returncode"] == expected


def test_preflight_only_runs_checks_without_the_workload(kit, tmp_path, marker):
    profile = kit.basic_profile(tmp_path, "CC: /usr/bin/gcc\n", tail="preflight: [c_compiler]\n")
    prepared = kit.staged(tmp_path, profile, env_dump_workload(kit, tmp_path, marker))
    done = kit.run_runner(prepared, "--preflight-only")
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "passed" and record["preflight_only"] is True
    assert record["checks"] == ["c_compiler"]
    assert record["observed"]["c_compiler"]["cc"] == "/usr/bin/gcc"
    assert done.stdout == (
        "koochak-run: preflight passed (manifest, config, requirements, c_compiler); "
        f"recorded in {prepared.preflight_path}\n"
    )


def test_a_broken_compiler_fails_before_model_code(kit, tmp_path, marker):
    bad_cc = tmp_path / "cc"
    bad_cc.write_text("#!/bin/sh\necho 'cc: fatal error: no toolchain' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    profile = kit.basic_profile(tmp_path, f"CC: {bad_cc}\n", tail="preflight: [c_compiler]\n")
    prepared = kit.staged(tmp_path, profile, env_dump_workload(kit, tmp_path, marker))
    done = kit.run_runner(prepared)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "c_compiler" and "no toolchain" in line["error"]
    assert not marker.exists()
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["state"] == "failed" and record["check"] == "c_compiler"


def test_koochak_run_ignores_an_ambient_pythonpath(kit, tmp_path, marker):
    """The console script re-executes under -I: a poisoned PYTHONPATH never shapes the runner."""
    import subprocess

    poison = tmp_path / "poison"
    poison.mkdir()
    (poison / "yaml.py").write_text("raise ImportError('ambient yaml was imported')\n")
    (poison / "json.py").write_text("raise ImportError('ambient json was imported')\n")
    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), env_dump_workload(kit, tmp_path, marker)
    )
    script = os.path.join(os.path.dirname(sys.executable), "koochak-run")
    env = dict(os.environ, PYTHONPATH=str(poison))
    done = subprocess.run(
        [script, *prepared.runner_argv[4:]], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    done = subprocess.run([script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 64 and "usage:" in done.stderr


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda d: d.update(extra=1), "unknown field 'extra'"),
        (lambda d: d.update(version=2), "version=2"),
        (
            lambda d: d["environment"]["inherit"].append("PYTHONPATH"),
            "'PYTHONPATH' is not runtime-owned",
        ),
        (lambda d: d["environment"]["secrets"].append("SLURM_JOB_ID"), "not a secret name"),
        (lambda d: d["environment"].pop("set"), "missing field 'environment.set'"),
        (lambda d: d.update(cwd="relative"), "field 'cwd' must be an absolute path"),
    ],
)
def test_a_manifest_with_the_right_digest_is_still_read_strictly(
    kit, tmp_path, marker, edit, expected
):

    from koochak.jobs.manifest import encode_manifest

    prepared = kit.staged(
        tmp_path, kit.basic_profile(tmp_path), env_dump_workload(kit, tmp_path, marker)
    )
    doc = prepared.manifest
    edit(doc)
    forged = tmp_path / "forged.json"
    forged.write_bytes(encode_manifest(doc))
    digest = hashlib.sha256(forged.read_bytes()).hexdigest()
    import subprocess

    done = subprocess.run(
        [*prepared.runner_argv[:4], str(forged), digest], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == "manifest" and expected in line["error"], line
    assert not marker.exists()

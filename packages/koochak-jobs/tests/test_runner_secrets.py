"""A secret's value never reaches what the runner writes, even when foreign output quotes it:
a compiler wrapper, a package's import error or version, the cuda and torch_compile checks'
output (a stand-in torch), required files and executables. preflight.json (0444, on shared
storage) and the runner's JSON stderr line hold ``[masked NAME]`` instead; the workload learns
which names are secret (``KOOCHAK_SECRET_NAMES``), never more."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# Quotes and a backslash, so its JSON-escaped form differs from the value itself.
TOKEN = 'trk-"9Zq\\Lw-7f3e1c"-2b'
# The value, its escaped forms, and fragments a cut through it would leave.
FORMS = (TOKEN, json.dumps(TOKEN)[1:-1], repr(TOKEN)[1:-1], "trk-", "9Zq", "7f3e1c")


def env_with_token() -> dict[str, str]:
    return dict(os.environ, TRACKING_TOKEN=TOKEN)


def assert_masked(kit, tmp_path: Path, done, check: str, shown: bool = True) -> dict:
    """The run failed closed on ``check``; neither stderr nor any file holds the token or a
    fragment of it (``shown``: the error still shows where it was masked)."""
    assert done.returncode == 78, done.stderr
    line = kit.failure(done.stderr)
    assert line["check"] == check, line
    assert not shown or "[masked TRACKING_TOKEN]" in line["error"], line
    written = [Path(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    for form in FORMS:
        assert form not in done.stderr + done.stdout, form
        for path in written:
            assert form.encode() not in path.read_bytes(), (form, path)
    return line


def profile_with(kit, tmp_path, extra_set="", tail=""):
    return kit.basic_profile(tmp_path, extra_set, "secrets: [TRACKING_TOKEN]\n", tail)


def test_a_compiler_wrapper_that_prints_the_token(kit, tmp_path, marker):
    cc = tmp_path / "cc"
    cc.write_text(
        '#!/bin/sh\necho "cc: cannot reach license server with token $TRACKING_TOKEN" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    profile = profile_with(kit, tmp_path, f"CC: {cc}\n", "preflight: [c_compiler]\n")
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    done = kit.run_runner(kit.staged(tmp_path, profile, script), env=env_with_token())
    line = assert_masked(kit, tmp_path, done, "c_compiler")
    assert "cannot reach license server" in line["error"] and not marker.exists()


def test_a_package_whose_import_error_holds_the_token(kit, tmp_path, marker):
    lib = tmp_path / "lib"
    lib.mkdir()
    # A long message: the token sits where the 300-character cut falls, so cutting before
    # masking would leave its head in the message.
    (lib / "tracker.py").write_text(
        "import os\nraise RuntimeError('x' * 240 + ' login refused for ' + "
        "repr(os.environ['TRACKING_TOKEN']))\n"
    )
    profile = profile_with(
        kit, tmp_path, f"PYTHONPATH: {lib}\n", "requirements:\n  packages: {tracker: '*'}\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    done = kit.run_runner(kit.staged(tmp_path, profile, script), env=env_with_token())
    line = assert_masked(kit, tmp_path, done, "requirements.packages", shown=False)
    assert "login refused for '[mask" in line["error"] and line["error"].endswith("...")
    assert not marker.exists()


def test_a_package_version_holding_the_token_is_masked_in_observed(kit, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tracker.py").write_text("import os\n__version__ = os.environ['TRACKING_TOKEN']\n")
    profile = profile_with(
        kit, tmp_path, f"PYTHONPATH: {lib}\n", "requirements:\n  packages: {tracker: '*'}\n"
    )
    names = tmp_path / "names.txt"
    script = kit.workload(
        tmp_path,
        "import os, sys\n"
        "open(sys.argv[1], 'w').write(os.environ.get('KOOCHAK_SECRET_NAMES', '-'))\n",
    )
    prepared = kit.staged(tmp_path, profile, script, python_args=[str(script), str(names)])
    done = kit.run_runner(prepared, env=env_with_token())
    assert done.returncode == 0, done.stderr
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert record["observed"]["package:tracker"] == "[masked TRACKING_TOKEN]"
    assert names.read_text() == "TRACKING_TOKEN"  # the workload learns the name only
    for form in FORMS:
        assert form not in Path(prepared.preflight_path).read_text()


FAKE_TORCH = """\
import os, sys
sys.stderr.write("CUDA driver refused the session token " + os.environ["TRACKING_TOKEN"] + "\\n")
raise SystemExit("torch stand-in: " + repr(os.environ["TRACKING_TOKEN"]))
"""


@pytest.mark.parametrize("check", ["cuda", "torch_compile"])
def test_the_cuda_and_torch_compile_checks_output_is_masked(kit, tmp_path, marker, check):
    lib = tmp_path / "lib"
    (lib / "torch").mkdir(parents=True)
    (lib / "torch" / "__init__.py").write_text(FAKE_TORCH)
    compilers = "CC: /usr/bin/cc\nCXX: /usr/bin/c++\n" if check == "torch_compile" else ""
    profile = profile_with(
        kit, tmp_path, f"PYTHONPATH: {lib}\n{compilers}", f"preflight: [{check}]\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    done = kit.run_runner(kit.staged(tmp_path, profile, script), env=env_with_token())
    line = assert_masked(kit, tmp_path, done, check)
    assert "CUDA driver refused" in line["error"] and not marker.exists()


@pytest.mark.parametrize("kind", ["files", "executables"])
def test_required_files_and_executables(kit, tmp_path, marker, kind):
    """Their messages quote manifest paths and OS errors; a path that holds the value (which
    the profile itself then holds) is still masked in what the runner writes."""
    missing = tmp_path / "secret-dir" / "x"
    profile = profile_with(kit, tmp_path, tail=f"requirements:\n  {kind}: ['{missing}']\n")
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    prepared = kit.staged(tmp_path, profile, script)
    env = dict(os.environ, TRACKING_TOKEN=str(missing))
    done = kit.run_runner(prepared, env=env)
    assert done.returncode == 78
    line = kit.failure(done.stderr)
    assert line["check"] == f"requirements.{kind}"
    assert str(missing) not in line["error"] and "[masked TRACKING_TOKEN]" in line["error"]
    record = json.loads(Path(prepared.preflight_path).read_text())
    assert str(missing) not in record["error"]


@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc")
def test_a_short_secret_is_masked_too(kit, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\necho "pin is $TRACKING_TOKEN" >&2\nexit 1\n')
    cc.chmod(0o755)
    profile = profile_with(kit, tmp_path, f"CC: {cc}\n", "preflight: [c_compiler]\n")
    script = kit.workload(tmp_path, "pass\n")
    done = kit.run_runner(
        kit.staged(tmp_path, profile, script), env=dict(os.environ, TRACKING_TOKEN="7")
    )
    line = kit.failure(done.stderr)
    assert "pin is [masked TRACKING_TOKEN]" in line["error"]


# Assembled at run time: the files a test writes hold its pieces, never the whole marker.
URL_PASSWORD_CODE = '"".join(["Pw-url-", "marker-5u8x"])'
URL_PASSWORD = "Pw-url-marker-5u8x"


def assert_no_url_password(tmp_path: Path, done) -> None:
    assert URL_PASSWORD not in done.stdout + done.stderr
    for directory, _, files in os.walk(tmp_path):
        for name in files:
            assert URL_PASSWORD.encode() not in Path(directory, name).read_bytes(), name


def test_a_url_password_in_a_package_import_error_is_masked_without_named_secrets(
    kit, tmp_path, marker
):
    """No profile secrets at all: a URL's user info in foreign text is masked all the same."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "tracker.py").write_text(
        f"raise RuntimeError('cannot reach https://bot:' + {URL_PASSWORD_CODE} + '@track:443/')\n"
    )
    profile = kit.basic_profile(
        tmp_path, f"PYTHONPATH: {lib}\n", "", "requirements:\n  packages: {tracker: '*'}\n"
    )
    script = kit.workload(tmp_path, f"open({str(marker)!r}, 'w').close()\n")
    prepared = kit.staged(tmp_path, profile, script)
    done = kit.run_runner(prepared)
    assert done.returncode == 78, done.stderr
    line = kit.failure(done.stderr)
    assert "https://***@track:443/" in line["error"], line
    assert "https://***@track:443/" in Path(prepared.preflight_path).read_text()
    assert_no_url_password(tmp_path, done)


TRAIN_USER = f"""
import torch

PASSWORD = {URL_PASSWORD_CODE}


def make_model(cfg):
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 1)


def url_step(model, batch, ctx):
    if ctx.step == 1:
        raise ConnectionError("cannot reach https://trainer:" + PASSWORD + "@minio:9000/ckpt")
    x, y = batch
    return {{"loss": ((model(x) - y) ** 2).mean()}}
"""


@pytest.mark.slow
def test_a_url_password_in_a_koochak_train_step_error_reaches_no_stream_or_file(kit, tmp_path):
    """koochak-train as the workload of koochak-run: the step's error quotes a URL with a
    password; neither the runner's nor the workload's streams, nor any file, hold it."""
    (tmp_path / "urluser.py").write_text(TRAIN_USER)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "train: {max_steps: 4, device: cpu, out_dir: " + str(tmp_path / "train")
        + ", progress_bar: false}\n"
        "optim: {optimizer: {name: sgd, lr: 0.1}}\n"
        'entry: {model: "urluser:make_model", dataset: "urluser:dataset", '
        'step: "urluser:url_step"}\n'
    )
    script = kit.workload(
        tmp_path,
        "import sys\nfrom koochak.loop.cli import main\n"
        f"sys.exit(main(['--config', {str(config)!r}, '--resume', 'none']))\n",
    )
    prepared = kit.staged(tmp_path, kit.basic_profile(tmp_path), script)
    done = kit.run_runner(prepared, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "cannot reach https://***@minio:9000/ckpt" in done.stderr, done.stderr
    assert_no_url_password(tmp_path, done)

"""koochak-train under a runner that names secrets (KOOCHAK_SECRET_NAMES): an exception message,
a warning, a --debug traceback or a GPU health record that quotes a secret's value is masked
before it is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from koochak.events.secrets import mask_secrets
from koochak.loop.cli import main
from koochak.loop.health import GpuHealthWatchdog, GpuReading
from koochak.loop.masking import mask_text
from koochak.storage.redact import redact_text

TOKEN = 'trk-"9Zq\\Lw-7f3e1c"-2b'
FRAGMENTS = (TOKEN, json.dumps(TOKEN)[1:-1], repr(TOKEN)[1:-1], "9Zq", "7f3e1c")

USER = """
import os
import warnings

import torch


def make_model(cfg):
    return torch.nn.Linear(2, 1)


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 1)


def leaky_step(model, batch, ctx):
    if ctx.step == 2:
        raise RuntimeError("tracking server said: bad token " + repr(os.environ["TRACKING_TOKEN"]))
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}


def leaky_model(cfg):
    raise PermissionError("login with " + os.environ["TRACKING_TOKEN"] + " refused")


def url_step(model, batch, ctx):
    if ctx.step == 1:
        raise ConnectionError(
            "cannot reach https://trainer:" + os.environ["URL_PASSWORD"] + "@minio.internal:9000"
            "/ckpt?X-Amz-Signature=" + os.environ["URL_PASSWORD"] + " with key "
            + os.environ["AWS_SECRET_ACCESS_KEY"]
        )
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}


def url_hook(info):
    raise ConnectionError("tracker https://bot:" + os.environ["URL_PASSWORD"] + "@track/ down")


def leaky_hook(info):
    raise ConnectionError("tracker at https://x/?t=" + os.environ["TRACKING_TOKEN"] + " down")
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"masking_user_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KOOCHAK_SECRET_NAMES", "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(f"""
        train: {{max_steps: 4, device: cpu, out_dir: {tmp_path / "run"}, progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.1}}}}
        logging: {{stdout: false}}
        entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:leaky_step"}}
        """)
    )
    return config, name


def assert_clean(text: str) -> None:
    for fragment in FRAGMENTS:
        assert fragment not in text, fragment
    assert "[masked TRACKING_TOKEN]" in text


def test_a_training_failure_line_masks_the_token(project, capsys):
    config, _ = project
    assert main(["--config", str(config), "--resume", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracking server said: bad token" in err[0]
    assert_clean(err[0])


def test_an_entry_failure_line_masks_the_token(project, capsys):
    config, name = project
    assert main(["--config", str(config), f"entry.model={name}:leaky_model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "entry.model=" in err[0] and "PermissionError" in err[0]
    assert_clean(err[0])


def test_debug_prints_the_traceback_masked_and_returns_the_code(project, capsys):
    config, _ = project
    assert main(["--config", str(config), "--resume", "none", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError" in err
    assert_clean(err)


def test_without_named_secrets_nothing_changes(project, monkeypatch, capsys):
    config, _ = project
    monkeypatch.delenv("KOOCHAK_SECRET_NAMES")
    assert mask_text(f"x {TOKEN}") == f"x {TOKEN}"
    with pytest.raises(RuntimeError):  # --debug re-raises, as it always did
        main(["--config", str(config), "--resume", "none", "--debug"])


def test_a_gpu_health_record_masks_a_kernel_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KOOCHAK_SECRET_NAMES", "TRACKING_TOKEN")
    monkeypatch.setenv("TRACKING_TOKEN", TOKEN)
    reading = GpuReading(device="cuda:0", kernel_ok=False, kernel_error=f"driver: {TOKEN}")
    dog = GpuHealthWatchdog(1, "cpu", out_dir=tmp_path, reader=lambda device: reading, env={})
    assert not dog.check(0).healthy
    text = (tmp_path / "gpu_health.jsonl").read_text()
    assert_clean(text)


@pytest.mark.slow
def test_warnings_and_the_error_line_of_a_real_process_are_masked(project, tmp_path):
    """A hook that fails with the token in its message warns (on stderr) and the step's error
    ends the run: the process's whole output holds the masked form only."""
    config, name = project
    argv = [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none"]
    code = f"import koochak.loop.cli as c, {name} as u, sys\n"
    code += "real = c.build_hooks\n"
    code += "c.build_hooks = lambda cfg: {**real(cfg), 'on_step_end': [u.leaky_hook]}\n"
    code += f"sys.argv = {argv[2:]!r}\nsys.exit(c.main())\n"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1, done.stderr
    assert "hook" in done.stderr and "ConnectionError" in done.stderr  # the warning
    assert "tracking server said" in done.stderr  # the error line
    assert_clean(done.stdout + done.stderr)


@pytest.mark.slow
def test_wandb_does_not_copy_unmasked_output_into_its_run_files(project, tmp_path):
    """W&B's console capture would record what the run prints before the masking sees it:
    under named secrets it is off, so the offline run's files never hold the token."""
    pytest.importorskip("wandb")
    config, name = project
    with open(tmp_path / f"{name}.py", "a") as f:
        f.write(
            "\n\ndef chatty_step(model, batch, ctx):\n"
            "    print('using token', os.environ['TRACKING_TOKEN'], flush=True)\n"
            "    x, y = batch\n"
            "    return {'loss': ((model(x) - y) ** 2).mean()}\n"
        )
    home = tmp_path / "wandb-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        {f"WANDB_{k}_DIR": str(home / k.lower()) for k in ("CACHE", "DATA", "CONFIG", "ARTIFACT")}
    )
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    argv = [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none"]
    argv += [f"entry.step={name}:chatty_step", "wandb.enabled=true", "wandb.mode=offline"]
    argv += [f"wandb.dir={tmp_path / 'wandb-run'}"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "using token [masked TRACKING_TOKEN]" in done.stdout
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "wandb-run") for f in fs]
    assert any(f.endswith(".wandb") for f in files), files
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        for fragment in FRAGMENTS:
            assert fragment.encode() not in data, (fragment, path)


URL_PASSWORD = "Pw-url-marker-5u8x"  # in a URL's user info: masked with no named secrets
AWS_SECRET = "AwsSecretMarker0123456789"


@pytest.fixture
def unnamed(project, monkeypatch):
    """No named secrets (a plain koochak-train run): URL passwords and AWS credentials only."""
    monkeypatch.delenv("KOOCHAK_SECRET_NAMES")
    monkeypatch.setenv("URL_PASSWORD", URL_PASSWORD)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    return project


def assert_no_credentials(text: str, where: str = "output") -> None:
    for marker in (URL_PASSWORD, AWS_SECRET):
        assert marker not in text, (marker, where)


def assert_no_credentials_in_files(root) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
            for marker in (URL_PASSWORD, AWS_SECRET):
                assert marker.encode() not in data, (marker, name)


def test_a_url_password_and_an_aws_secret_in_a_step_error_reach_no_stream_or_file(
    unnamed, tmp_path, capsys
):
    config, name = unnamed
    args = ["--config", str(config), "--resume", "none", f"entry.step={name}:url_step",
            "logging.stdout=true"]  # fmt: skip
    assert main(args) == 1
    out, err = capsys.readouterr()
    (line,) = [ln for ln in err.splitlines() if "training failed" in ln]
    assert "https://***@minio.internal:9000/ckpt?X-Amz-Signature=***" in line
    assert "with key [masked AWS_SECRET_ACCESS_KEY]" in line
    assert_no_credentials(out + err)
    assert main([*args, "--debug"]) == 1  # the traceback holds them: printed here, masked
    out, err = capsys.readouterr()
    assert "Traceback" in err and "ConnectionError" in err
    assert_no_credentials(out + err)
    assert_no_credentials_in_files(tmp_path)


def test_mask_secrets_and_redact_text_apply_the_same_rules(monkeypatch):
    """koochak.events may not import koochak.storage: the two copies of the rule are held to
    the same answers here."""
    samples = [
        "cannot reach https://bob:Hunter2-pass@minio:9000/bucket/key: refused",
        "s3://AKIAEXAMPLE:sec@ret@bucket/obj and ftp://anon@host/file",
        "GET http://h/o?X-Amz-Credential=AKIA%2F20261201&X-Amz-Signature=deadbeef&x=1",
        "Authorization: AWS4-HMAC-SHA256 Credential=AKIAX/2026, Signature=0123abcd",
        f"the key {AWS_SECRET} was refused (as JSON: \"{AWS_SECRET}\")",
        "nothing here: ordinary text, a path /a/b@c and an email bob@example.org",
    ]
    for env in ({}, {"AWS_SECRET_ACCESS_KEY": AWS_SECRET, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"}):
        for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for text in samples:
            assert mask_secrets(text, {}) == redact_text(text), text
    assert AWS_SECRET not in mask_secrets(samples[4], {})
    monkeypatch.setenv("AWS_SESSION_TOKEN", "short")  # under 8 characters: left alone
    assert mask_secrets("a short word", {}) == "a short word"


@pytest.mark.slow
def test_a_real_koochak_train_process_writes_no_url_password(unnamed, tmp_path):
    """A hook's warning and the step's error line, through the real streams of a process."""
    config, name = unnamed
    argv = ["--config", str(config), "--resume", "none", f"entry.step={name}:url_step"]
    code = f"import koochak.loop.cli as c, {name} as u, sys\n"
    code += "real = c.build_hooks\n"
    code += "c.build_hooks = lambda cfg: {**real(cfg), 'on_step_end': [u.url_hook]}\n"
    code += f"sys.argv = ['koochak-train', *{argv!r}]\nsys.exit(c.main())\n"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1, done.stderr
    assert "tracker https://***@track/ down" in done.stderr  # the hook's warning
    assert "cannot reach https://***@minio.internal" in done.stderr  # the error line
    assert_no_credentials(done.stdout + done.stderr)
    assert_no_credentials_in_files(tmp_path)


MARKED_USER = """
import torch


def make_model(cfg, *, token: str = "", plain: str = "", width: int = 1, endpoint: str = ""):
    assert token.startswith("tok-MARKER1") and int(width) == 7  # the run itself sees the values
    return torch.nn.Linear(2, int(width))


def dataset(cfg, start_step=0):
    while True:
        yield torch.ones(2, 2), torch.ones(2, 7)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": ((model(x) - y) ** 2).mean()}
"""


def test_no_credential_input_reaches_any_file_the_run_writes(tmp_path, monkeypatch, capsys):
    """A marker in every way a credential gets into a run: a secret the profile names read with
    ${oc.env:...}, an unnamed variable read with ${oc.env:...} (in a file and in an override, a
    number among them), the AWS secret key, a password in a URL. None is in any file of out_dir
    (config.yaml, checkpoints, logs, the history) nor on stdout/stderr."""
    name = f"marked_user_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(MARKED_USER)
    monkeypatch.chdir(tmp_path)
    markers = {"TRACKING_TOKEN": "tok-MARKER1-aa", "PLAIN_SETTING": "MARKER2-plain-value",
               "AWS_SECRET_ACCESS_KEY": "MARKER3-aws-secret-key", "WIDTH_FROM_ENV": "7",
               "OVERRIDE_SECRET": "MARKER5-from-override"}  # fmt: skip
    for variable, value in markers.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("KOOCHAK_SECRET_NAMES", "TRACKING_TOKEN")
    run = tmp_path / "run"
    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(f"""
        train: {{max_steps: 3, ckpt_every: 1, device: cpu, out_dir: {run}, progress_bar: false}}
        optim: {{optimizer: {{name: sgd, lr: 0.1}}}}
        model:
          token: ${{oc.env:TRACKING_TOKEN}}
          plain: "prefix-${{oc.env:PLAIN_SETTING}}"
          width: ${{oc.env:WIDTH_FROM_ENV}}
          endpoint: "https://bot:MARKER4-url-password@tracker.internal/x"
        wandb: {{project: "${{oc.env:AWS_SECRET_ACCESS_KEY}}"}}
        entry: {{model: "{name}:make_model", dataset: "{name}:dataset", step: "{name}:step_fn"}}
        """))  # fmt: skip
    override = "model.plain=${oc.env:OVERRIDE_SECRET}"
    assert main(["--config", str(config), "--resume", "none", override]) == 0
    assert main(["--config", str(config), "train.max_steps=4", override]) == 0  # resumes: same
    out = capsys.readouterr()
    found = [p for p in run.rglob("*") if p.is_file()]
    assert (run / "config.yaml") in found and (run / "step000000004.pt") in found
    for marker in ("MARKER1", "MARKER2", "MARKER3", "MARKER4", "MARKER5"):
        for path in found:
            assert marker.encode() not in path.read_bytes(), (marker, path)
        assert marker not in out.out + out.err, marker
    import torch
    import yaml

    recorded = torch.load(run / "step000000004.pt", weights_only=True)["config"]["model"]
    assert recorded["token"] == "[masked TRACKING_TOKEN]"
    assert recorded["plain"] == "[masked OVERRIDE_SECRET]"
    assert recorded["width"] == "[masked WIDTH_FROM_ENV]"
    assert yaml.safe_load((run / "config.yaml").read_text())["model"] == recorded

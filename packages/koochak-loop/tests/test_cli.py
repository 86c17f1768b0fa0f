"""koochak-train: config + entry points -> training_loop; one-line errors with exit codes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from koochak.loop.cli import main, run_with_one_line_errors

USER_CODE = """
import torch
from torch.nn import functional as F


def make_model(cfg):
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(int(cfg.train.seed) + start_step)
    while True:
        x = torch.randn(cfg.data.batch_size, 3, generator=gen)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}


def val_dataset(cfg):
    return [(torch.ones(4, 3), torch.full((4, 1), 3.0))]


def eval_fn(model, data, ctx):
    return {"loss": sum(float(F.mse_loss(model(x), y)) for x, y in data)}


def broken_step(model, batch, ctx):
    raise RuntimeError("user code exploded")


def exiting_step(model, batch, ctx):
    import os
    import sys

    if ctx.step == 2:
        sys.exit(int(os.environ.get("USER_EXIT_CODE", "0")) or None)
    return step_fn(model, batch, ctx)


def make_optimizer(model, cfg):
    return torch.optim.SGD(model.parameters(), lr=cfg.model.factory_lr)


def stop_after_first_eval(cfg):
    from koochak.loop.hooks import StopTraining

    def on_eval_end(info):
        raise StopTraining("good enough")

    return {"on_eval_end": [on_eval_end]}


def not_an_optimizer(model, cfg):
    return "adam please"


def dataset_signalled_while_built(cfg, start_step=0):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler asks us to leave during setup
    return dataset(cfg, start_step)
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user project in the working directory: a module of entry points and a config."""
    name = f"userpkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            train:
              max_steps: 6
              log_every: 2
              eval_every: 3
              device: cpu
              out_dir: {tmp_path / "run"}
              progress_bar: false
            data:
              batch_size: 4
            optim:
              optimizer: {{name: sgd, lr: 0.05}}
              scheduler: {{name: cosine}}
            logging:
              stdout: true
            entry:
              model: {name}:make_model
              dataset: {name}:dataset
              step: {name}:step_fn
              eval_dataset: {name}:val_dataset
              eval_fn: {name}:eval_fn
            """
        )
    )
    return tmp_path, name, config


def test_runs_end_to_end_and_writes_logs_and_checkpoint(project, capsys):
    root, _, config = project
    assert main(["--config", str(config), "--resume", "none"]) == 0
    out = capsys.readouterr().out
    assert "strict_config: true" in out and "koochak: Linear with 4 parameters" in out
    run = root / "run"
    assert (run / "log.csv").exists() and (run / "log.jsonl").exists()
    ckpt = torch.load(run / "step000000006.pt", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["config"]["optim"]["optimizer"]["name"] == "sgd"
    assert "eval_loss" in ckpt["metrics"]


def test_model_section_param_groups_optimizer_factory_and_tensorboard(project, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, name, config = project
    common = ["--config", str(config), "--resume", "none", "model.factory_lr=0.25",
              "logging.tensorboard=true"]  # fmt: skip
    rules = "optim.optimizer.param_groups=[{names: ['bias'], lr: 0.5}]"
    assert (
        main([*common, rules, "optim.optimizer.name=adamw", "optim.optimizer.foreach=false"]) == 0
    )
    checkpoint = torch.load(root / "run" / "step000000006.pt", weights_only=True)
    groups = checkpoint["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups][1:] and groups[1]["initial_lr"] == 0.5
    assert groups[0]["foreach"] is False
    events = EventAccumulator(str(root / "run" / "tensorboard"))
    events.Reload()
    assert {"loss", "eval_loss", "lr"} <= set(events.Tags()["scalars"])

    factory = f"entry.optimizer={name}:make_optimizer"
    assert main([*common, factory, "train.out_dir=" + str(root / "factory")]) == 0
    groups = torch.load(root / "factory" / "step000000006.pt", weights_only=True)["optimizer"]
    assert groups["param_groups"][0]["initial_lr"] == 0.25  # built by the factory from model:


def test_entry_hooks_can_stop_the_run_with_exit_0(project, capsys):
    root, name, config = project
    args = [
        "--config",
        str(config),
        "--resume",
        "none",
        f"entry.hooks={name}:stop_after_first_eval",
    ]
    assert main(args) == 0
    assert "koochak: stopped at step 3 (good enough)" in capsys.readouterr().out
    checkpoint = torch.load(root / "run" / "step000000003.pt", weights_only=True)
    assert checkpoint["reason"] == "stopped"


def test_help_points_at_the_config_template(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "examples/config_template.yaml" in capsys.readouterr().out


def test_overrides_apply_last(project):
    root, _, config = project
    assert main(["--config", str(config), "train.max_steps=2", "--resume", "none"]) == 0
    assert (root / "run" / "step000000002.pt").exists()


def test_overrides_on_both_sides_of_a_flag_all_apply(project):
    root, _, config = project
    args = ["--config", str(config), "train.max_steps=2", "--resume", "none", "train.log_every=1"]
    assert main(args) == 0
    assert (root / "run" / "step000000002.pt").exists()
    ckpt = torch.load(root / "run" / "step000000002.pt", weights_only=True)
    assert ckpt["config"]["train"]["log_every"] == 1 and ckpt["config"]["train"]["max_steps"] == 2


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "entry.model=nowhere_pkg:make_model",
            "entry.model='nowhere_pkg:make_model': cannot import module 'nowhere_pkg'",
        ),
        ("entry.step={name}:nope", "entry.step='{name}:nope': module '{name}' has no attribute"),
        ("entry.dataset=nocolon", "entry.dataset: expected 'module:callable', got 'nocolon'"),
        ("entry.model=null", "entry.model is not set: add it to the config's entry section"),
        ("entry.step={name}:step_fm", "(did you mean '{name}:step_fn'?)"),
        ("train.max_stpes=3", "did you mean 'train.max_steps'"),
        ("trian.max_steps=3", "unknown config key 'trian' (did you mean 'train'?)"),
        ("train.max_steps=many", "train.max_steps: expected int or null, got 'many'"),
        ("train.max_steps", "override 'train.max_steps': expected key=value"),
        ("train.amp=fp8", "train.amp: expected one of none|bf16|fp16, got 'fp8'"),
        ("optim.optimizer.name=lion", "lion"),
        ("train.device=tpu9", "train.device: expected one of auto|cpu|cuda|cuda:N|mps, got 'tpu9'"),
        ("train.ddp=true", "environment lacks RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        ("train.checkpoint_dir=nope://x", "no store is registered for scheme 'nope'"),
        ("train.fsdp.shard_size=2", "train.fsdp.shard_size: set only with train.fsdp.hsdp: true"),
        ("data.batch_size=0", "data.batch_size: expected an integer >= 1, got 0"),
        (
            "entry.optimizer={name}:not_an_optimizer",
            "entry.optimizer: {name}:not_an_optimizer returned str, not a torch.optim.Optimizer",
        ),
        (
            "optim.optimizer.param_groups=[{{weight_decay: 0.0}}]",
            "optim.optimizer.param_groups[0]: needs a selector: names, modules, max_ndim",
        ),
    ],
)
def test_bad_input_is_one_line_on_stderr_exit_2(project, capsys, override, expected):
    _, name, config = project
    code = main(["--config", str(config), override.format(name=name), "--resume", "none"])
    assert code == 2
    line = one_line_error(capsys)
    assert line.startswith("koochak-train: error: ")
    assert expected.format(name=name) in line


def test_hsdp_shard_groups_that_do_not_tile_the_world_are_a_usage_error(
    project, capsys, monkeypatch
):
    _, _, config = project
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999")):  # fmt: skip
        monkeypatch.setenv(name, value)
    code = main(["--config", str(config), "train.fsdp.enabled=true", "train.fsdp.hsdp=true",
                 "train.fsdp.shard_size=2", "--resume", "none"])  # fmt: skip
    assert code == 2
    line = one_line_error(capsys)
    assert "train.fsdp.shard_size: 2 ranks per shard group, but the world size 1" in line


@pytest.mark.parametrize("key", ["train.ddp", "train.fsdp.enabled"])
def test_a_distributed_config_on_one_process_says_how_to_run_it(project, capsys, monkeypatch, key):
    """Resuming a 2-rank run on one process: the error names key=false, and the launcher."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    _, _, config = project
    assert main(["--config", str(config), f"{key}=true"]) == 2
    line = one_line_error(capsys)
    assert line.startswith(f"koochak-train: error: {key} is true but no process group exists")
    assert f"set {key}=false" in line and "python -m koochak.loop.launch" in line


def test_warmup_longer_than_the_run_names_the_fix(project, capsys):
    _, _, config = project
    args = ["optim.scheduler.name=cosine_warmup", "optim.scheduler.warmup_steps=10"]
    assert main(["--config", str(config), *args, "--resume", "none"]) == 2
    line = one_line_error(capsys)
    assert "warmup_steps=10 must be below the schedule length 6" in line
    assert line.endswith("set optim.scheduler.warmup_steps=0 or a longer schedule")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "c.yaml", "--resume", "nope"], "argument --resume: invalid choice: 'nope'"),
        (["train.max_steps=3"], "the following arguments are required: --config"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    line = one_line_error(capsys)
    assert expected in line and line.endswith("(see koochak-train --help)")


def test_scripts_get_one_line_errors_and_tracebacks_on_debug(capsys):
    def boom(args):
        raise ValueError("bad\n  thing")

    assert run_with_one_line_errors("prog", boom, []) == 1
    assert one_line_error(capsys) == (
        "prog: ValueError: bad thing (rerun with --debug for the traceback)"
    )
    with pytest.raises(ValueError, match="bad"):
        run_with_one_line_errors("prog", boom, ["--debug"])
    assert run_with_one_line_errors("prog", lambda args: None, []) == 0


def test_missing_config_file_exit_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: config file not found" in one_line_error(capsys)


def _alias_bomb() -> bytes:
    """Eight levels of nine aliases, about 1 KB: 9**8 leaves once expanded."""
    lines = ["data:", "  l0: &l0 [" + ", ".join(["x"] * 9) + "]"]
    lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 8)]
    return "\n".join(lines).encode() + b"\n"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00", "weights.yaml: not a UTF-8 text file"),
        (b"train:\n  seed: 1\n  seed: 2\n", "weights.yaml: not valid YAML: duplicate key 'seed'"),
        (
            _alias_bomb(),
            "weights.yaml: the YAML expands to more than 10,000 nodes",
        ),
    ],
    ids=["binary", "duplicate-key", "alias-bomb"],
)
def test_hostile_config_files_exit_2_naming_the_file(tmp_path, capsys, content, expected):
    path = tmp_path / "weights.yaml"
    path.write_bytes(content)
    assert main(["--config", str(path), "--resume", "none"]) == 2
    assert expected in one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda_exit_2(project, capsys):
    _, _, config = project
    assert main(["--config", str(config), "train.device=cuda", "--resume", "none"]) == 2
    assert "'cuda' requested but CUDA is not available" in one_line_error(capsys)


def test_a_malformed_newest_checkpoint_is_skipped_and_training_continues(project, capsys):
    import io

    from koochak.loop.checkpoint import build_checkpoint, checkpoint_store, publish

    root, _, config = project
    assert main(["--config", str(config), "--resume", "none"]) == 0  # terminal step000000006
    bad = build_checkpoint(step=9, next_step=10, model=torch.nn.Linear(3, 1))
    bad["rng"] = {"numpy": ("__koochak_ndarray__", "<u4", "not-a-shape", b"\0" * 8)}
    buffer = io.BytesIO()
    torch.save(bad, buffer)  # valid manifest and SHA256; the payload's array record is bad
    publish(checkpoint_store(root / "run"), "step000000009.pt", buffer.getvalue())
    capsys.readouterr()
    assert main(["--config", str(config), "train.max_steps=8", "--resume", "auto"]) == 0
    resumed = torch.load(root / "run" / "step000000008.pt", weights_only=True)
    assert resumed["step"] == 8 and resumed["reason"] == "terminal"


def test_wandb_restart_settings_are_checked_before_training(project, capsys):
    root, _, config = project
    assert main(["--config", str(config), "--resume", "none"]) == 0
    capsys.readouterr()
    args = ["wandb.enabled=true", "wandb.mode=offline", "train.max_steps=8"]
    assert main(["--config", str(config), *args, "--resume", "auto"]) == 2
    line = one_line_error(capsys)
    assert "wandb: this attempt resumes from checkpoint state (next step 6)" in line
    assert not (root / "run" / "wandb").exists()


def test_training_failure_exit_1_and_debug_shows_traceback(project, capsys):
    _, name, config = project
    args = ["--config", str(config), f"entry.step={name}:broken_step", "--resume", "none"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "user code exploded" in err and "Traceback" not in err and "--debug" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(RuntimeError, match="user code exploded"):
        main([*args, "--debug"])


@pytest.mark.parametrize(("user_code", "expected"), [("0", 1), ("3", 3)])
def test_sys_exit_in_the_training_code_is_never_a_silent_success(
    project, capsys, monkeypatch, user_code, expected
):
    root, name, config = project
    monkeypatch.setenv("USER_EXIT_CODE", user_code)
    args = ["--config", str(config), f"entry.step={name}:exiting_step", "--resume", "none"]
    assert main(args) == expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "called sys.exit(" in err[0] and "StopTraining" in err[0]
    assert not list((root / "run").glob("step*.pt"))  # no terminal checkpoint pretends it ended


@pytest.mark.slow
def test_python_dash_m_entry_point(project):
    root, _, config = project
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "koochak.loop.cli",
            "--config",
            str(config),
            "train.max_steps=2",
            "--resume",
            "none",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (root / "run" / "step000000002.pt").exists()


def test_sigusr1_while_the_dataset_is_built_evacuates_after_one_update(project, capsys):
    root, name, config = project
    args = [
        "--config",
        str(config),
        "train.evacuation_enabled=true",
        f"entry.dataset={name}:dataset_signalled_while_built",
    ]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 75
    run = root / "run"
    assert (run / "step000000001.pt.ready.json").exists()  # terminal: one update done


class _FakeScruffyClient:
    """The newer Scruffy v1 client contract (keyword-only publish_event with wait=/timeout=);
    tests-integration runs koochak-train under the faithful stub and its controller."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def publish_event(
        self,
        root,
        *,
        job_id,
        kind,
        data,
        event_id=None,
        occurred_at=None,
        source=None,
        wait=False,
        timeout=None,
    ):
        self.events.append({"kind": kind, "data": data, "event_id": event_id})
        return {
            "event_id": event_id,
            "job_id": job_id,
            "deduplicated": False,
            "state": "accepted" if wait else "spooled",
            "acknowledged": wait,
        }


def test_scruffy_worker_variables_attach_event_hooks(project, monkeypatch, capsys):
    import types

    root, _, config = project
    client = _FakeScruffyClient()
    module = types.ModuleType("scruffy")
    module.publish_event = client.publish_event
    monkeypatch.setitem(sys.modules, "scruffy", module)
    monkeypatch.setenv("SCRUFFY_ROOT", str(root / "queue"))
    monkeypatch.setenv("SCRUFFY_JOB_ID", "job-7")
    assert main(["--config", str(config), "--resume", "none"]) == 0
    kinds = [e["kind"] for e in client.events]
    assert kinds[0] == "workload.phase" and "workload.artifact" in kinds
    artifact = next(e for e in client.events if e["kind"] == "workload.artifact")
    assert artifact["data"]["publication"]["artifact_id"] == "checkpoint/step000000006.pt"


def test_scruffy_worker_without_a_client_fails_before_training(project, monkeypatch, capsys):
    root, _, config = project
    monkeypatch.setitem(sys.modules, "scruffy", None)  # import scruffy -> ImportError
    monkeypatch.setenv("SCRUFFY_ROOT", str(root / "queue"))
    monkeypatch.setenv("SCRUFFY_JOB_ID", "job-7")
    assert main(["--config", str(config), "--resume", "none"]) == 2
    assert "scruffy" in capsys.readouterr().err
    assert not (root / "run" / "step000000006.pt").exists()

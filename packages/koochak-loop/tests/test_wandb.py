"""W&B hooks against the real wandb client in offline mode, read back from the run files."""

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from koochak.loop.hooks import emit
from koochak.loop.logging import make_wandb_hooks
from koochak.loop.logging.wandb_logger import wandb_run_id

pytest.importorskip("wandb")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """Keep every W&B file (runs, caches, settings, staging) inside tmp_path, offline."""
    home = tmp_path / "wandb-home"
    for var, sub in [
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ]:
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    return tmp_path


def _records(run_file: Path) -> list:
    """Decode a .wandb run file: a 7-byte header, then LevelDB-log framed protobuf records."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            break  # the writer is still appending this record
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk completes a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _read_run(out_dir: Path, run_id: str) -> dict:
    (run_file,) = out_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    return _read_run_file(run_file)


def _read_attempts(out_dir: Path, run_id: str) -> list[dict]:
    """Every attempt's offline run file for ``run_id`` in ``out_dir``, oldest first."""
    files = sorted(
        out_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"),
        key=lambda path: path.stat().st_mtime_ns,
    )
    return [_read_run_file(path) for path in files]


def _read_run_file(run_file: Path) -> dict:
    # wandb's service process may still be flushing after finish(); wait for the exit record.
    # A read racing its writes may also catch a record half-written: read again.
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + 30
    while True:
        try:
            records = _records(run_file)
        except DecodeError:
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "wandb never wrote the run's exit record"
        time.sleep(0.1)
    config, history, artifacts, versions = {}, [], [], []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            history.append(
                {
                    i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "artifact":
            artifacts.append(
                (
                    record.artifact.name,
                    sorted(record.artifact.aliases),
                    [c.path for c in record.artifact.manifest.contents],
                )
            )
            versions.append(
                {
                    "metadata": json.loads(record.artifact.metadata or "{}"),
                    "refs": [c.ref for c in record.artifact.manifest.contents],
                }
            )
    return {"config": config, "history": history, "artifacts": artifacts, "versions": versions}


def _checkpoint(out_dir: Path, step: int, eval_loss: float) -> dict:
    path = out_dir / f"step{step:09d}.pt"
    checkpoint = {"step": step, "metrics": {"loss": 1.0, "eval_loss": eval_loss}}
    torch.save(checkpoint, path)
    return {"step": step, "path": str(path), "checkpoint": checkpoint, "publication": None}


@pytest.mark.slow
def test_offline_run_records_config_metrics_and_artifact_aliases(offline_wandb):
    out_dir = offline_wandb / "run"
    wandb_cfg = {
        "enabled": True,
        "mode": "offline",
        "project": "koochak-test",
        "name": "digits-a",
        "resume": "allow",
        "artifact_name_prefix": "ckpt",
    }
    config = {"train": {"max_steps": 30, "out_dir": str(out_dir)}, "wandb": wandb_cfg}
    run_id = wandb_run_id(wandb_cfg, out_dir)
    assert run_id == wandb_run_id(dict(wandb_cfg), str(out_dir))  # stable across attempts

    hooks = make_wandb_hooks(config)
    emit(
        hooks,
        "on_train_start",
        {"step": 0, "config_json": config, "out_dir": str(out_dir), "resumed": False},
    )
    emit(hooks, "on_log", {"step": 4, "metrics": {"loss": 2.0, "lr": 0.1}})
    emit(hooks, "on_eval_end", {"step": 9, "metrics": {"eval_loss": 1.5}})
    out_dir.mkdir(exist_ok=True)
    for step, eval_loss in [(9, 1.5), (19, 1.8), (29, 1.2)]:
        emit(hooks, "on_checkpoint", _checkpoint(out_dir, step, eval_loss))
    emit(hooks, "on_train_end", {"step": 30, "checkpoint": {}, "metrics": {}})

    run = _read_run(out_dir, run_id)
    assert run["config"]["train"] == {"max_steps": 30, "out_dir": str(out_dir)}
    assert {"loss": 2.0, "lr": 0.1, "_step": 4}.items() <= run["history"][0].items()
    assert run["history"][1]["eval_loss"] == 1.5
    name = f"ckpt-{run_id}"
    assert run["artifacts"] == [
        (name, ["best", "best-eval_loss", "latest", "step-9"], ["step000000009.pt"]),
        (name, ["latest", "step-19"], ["step000000019.pt"]),
        (name, ["best", "best-eval_loss", "latest", "step-29"], ["step000000029.pt"]),
    ]

    # A restart that resumes from checkpoint state continues the same run id.
    retry_dir = offline_wandb / "retry"
    hooks = make_wandb_hooks(config)
    emit(
        hooks,
        "on_train_start",
        {"step": 30, "config_json": config, "out_dir": str(retry_dir), "resumed": True},
    )
    emit(hooks, "on_log", {"step": 34, "metrics": {"loss": 0.5}})
    emit(hooks, "on_train_end", {"step": 35, "checkpoint": {}, "metrics": {}})
    assert _read_run(retry_dir, run_id)["history"][0]["loss"] == 0.5


@pytest.mark.slow
def test_best_alias_continues_from_the_resumed_checkpoint_after_a_restart(offline_wandb):
    out_dir = offline_wandb / "run"
    out_dir.mkdir()
    wandb_cfg = {"enabled": True, "mode": "offline", "name": "best-a", "resume": "allow"}
    config = {"wandb": wandb_cfg}
    run_id = wandb_run_id(wandb_cfg, out_dir)

    def attempt(start_step: int, versions: list[tuple[int, float]]) -> list:
        hooks = make_wandb_hooks(config)
        start = {"step": start_step, "config_json": config, "out_dir": str(out_dir)}
        emit(hooks, "on_train_start", {**start, "resumed": start_step > 0})
        for step, eval_loss in versions:
            emit(hooks, "on_checkpoint", _checkpoint(out_dir, step, eval_loss))
        emit(hooks, "on_train_end", {"step": versions[-1][0], "checkpoint": {}, "metrics": {}})
        return [aliases for _, aliases, _ in _read_attempts(out_dir, run_id)[-1]["artifacts"]]

    # First attempt: 1.2 at step 19 is the best; then the job dies after step 29 (1.8).
    assert attempt(0, [(9, 1.5), (19, 1.2), (29, 1.8)]) == [
        ["best", "best-eval_loss", "latest", "step-9"],
        ["best", "best-eval_loss", "latest", "step-19"],
        ["latest", "step-29"],
    ]
    # Resumed from step 29: 1.4 beats neither 1.5 nor 1.2, so it is not "best" (it was, before).
    assert attempt(30, [(39, 1.4), (49, 1.1)]) == [
        ["latest", "step-39"],
        ["best", "best-eval_loss", "latest", "step-49"],
    ]
    # Resumed from step 19 (newer checkpoints lost): the best as of step 19 is 1.2, and the 1.1
    # seen after it by a later attempt does not count for this state.
    assert attempt(20, [(29, 1.3), (39, 1.15)]) == [
        ["latest", "step-29"],
        ["best", "best-eval_loss", "latest", "step-39"],
    ]


def test_best_record_skips_torn_lines_and_later_states(tmp_path):
    from koochak.loop.logging.wandb_logger import append_best_record, read_best_record

    path = tmp_path / "wandb" / "koochak-best-r1.jsonl"
    assert read_best_record(path, 10) == {}
    append_best_record(path, 9, 10, {"eval_loss": 1.5})
    append_best_record(path, 19, 20, {"eval_loss": 1.2})
    with open(path, "a") as f:
        f.write('{"version": 1, "step": 29, "next_st')  # the process died mid-line
    with pytest.warns(UserWarning, match="skipping line 3"):
        assert read_best_record(path, 10) == {"eval_loss": 1.5}
    with pytest.warns(UserWarning, match="skipping line 3"):
        assert read_best_record(path, 100) == {"eval_loss": 1.2}
    path.write_text('{"version": true, "step": 1, "next_step": 2, "best": {"loss": 1}}\n')
    with pytest.warns(UserWarning, match="version"):
        assert read_best_record(path, 5) == {}


@pytest.mark.parametrize(
    ("wandb_cfg", "message"),
    [
        ({"resume": None, "name": "a"}, "wandb.resume is None"),
        ({"resume": "allow"}, "neither wandb.name nor wandb.id"),
        ({"resume": "never", "id": "x1"}, "needs 'allow'"),
    ],
)
def test_resumed_attempt_without_restart_settings_refuses_to_start(
    offline_wandb, wandb_cfg, message
):
    cfg = {"enabled": True, "mode": "offline", **wandb_cfg}
    hooks = make_wandb_hooks(cfg)
    with pytest.raises(ValueError, match=message):
        emit(hooks, "on_train_start", {"step": 100, "out_dir": str(offline_wandb), "resumed": True})
    assert not (offline_wandb / "wandb").exists()  # refused before any run was created


def test_disabled_and_bad_configs(offline_wandb):
    assert make_wandb_hooks({"wandb": {"enabled": False}}) == {}
    assert make_wandb_hooks({"enabled": True, "mode": "disabled"}) == {}
    with pytest.raises(ValueError, match="unknown key.*'projcet'"):
        make_wandb_hooks({"enabled": True, "projcet": "x"})
    with pytest.raises(ValueError, match="wandb.resume"):
        make_wandb_hooks({"enabled": True, "resume": "yes"})


def test_missing_wandb_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match=r"koochak-loop\[wandb\]"):
        make_wandb_hooks({"enabled": True, "mode": "offline"})


@pytest.mark.slow
def test_training_loop_versions_its_checkpoints_as_one_artifact(offline_wandb):
    from koochak.loop import training_loop

    out_dir = offline_wandb / "loop"
    config = {"wandb": {"enabled": True, "mode": "offline", "id": "loop-run-1"}}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(6)]

    def step_fn(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    training_loop(
        model=model,
        dataset=data,
        step_fn=step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_cfg={
            "max_steps": 6,
            "log_every": 2,
            "ckpt_every": 3,
            "out_dir": str(out_dir),
            "device": "cpu",
            "keep_last_k": None,
        },
        config_json=config,
        hooks=make_wandb_hooks(config),
    )

    run = _read_run(out_dir, "loop-run-1")
    assert run["config"]["wandb"]["id"] == "loop-run-1"
    assert [row["_step"] for row in run["history"]] == [1, 3, 5]
    # Periodic checkpoints keep their zero-based index; the terminal one is named by count.
    assert [(aliases[-2:], files) for _, aliases, files in run["artifacts"]] == [
        (["latest", "step-2"], ["step000000002.pt"]),
        (["latest", "step-6"], ["step000000006.pt"]),  # no periodic save right before the terminal
    ]
    assert {name for name, _, _ in run["artifacts"]} == {"model-loop-run-1"}
    # Each version references the published file by its publication record.
    reference = run["versions"][0]["metadata"]["checkpoint"]
    path = out_dir / "step000000002.pt"
    assert reference["artifact_id"] == "checkpoint/step000000002.pt"
    assert reference["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_training_loop_resumed_without_restart_settings_stops_before_the_first_step(
    offline_wandb,
):
    from koochak.loop import training_loop

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]
    steps = []

    def step_fn(model, batch, ctx):
        steps.append(ctx.step)
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    def run(checkpoint, hooks, max_steps):
        return training_loop(
            model=model,
            dataset=data,
            step_fn=step_fn,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_cfg={
                "max_steps": max_steps,
                "out_dir": str(offline_wandb / "r"),
                "device": "cpu",
            },
            checkpoint_dict=checkpoint,
            hooks=hooks,
        )

    first = run(None, None, 2)
    hooks = make_wandb_hooks({"enabled": True, "mode": "offline", "project": "p"})
    steps.clear()
    with pytest.raises(ValueError, match="resumes from checkpoint state.*wandb.resume: allow"):
        run(first, hooks, 4)
    assert steps == []


def _staged(offline_wandb: Path) -> list[Path]:
    staging = offline_wandb / "wandb-home" / "data" / "artifacts" / "staging"
    return sorted(staging.iterdir()) if staging.exists() else []


def _versions(out_dir: Path, wandb_cfg: dict, steps: list[int], **config) -> dict:
    hooks = make_wandb_hooks({"wandb": wandb_cfg, **config})
    emit(hooks, "on_train_start", {"step": 0, "out_dir": str(out_dir), "resumed": False})
    out_dir.mkdir(exist_ok=True)
    for step in steps:
        emit(hooks, "on_checkpoint", _checkpoint(out_dir, step, 1.0 / (step + 1)))
    emit(hooks, "on_train_end", {"step": steps[-1] + 1, "checkpoint": {}, "metrics": {}})
    return _read_run(out_dir, wandb_cfg["id"])


@pytest.mark.slow
def test_checkpoints_are_referenced_by_path_and_digest_and_nothing_is_staged(offline_wandb):
    out_dir = offline_wandb / "run"
    wandb_cfg = {"enabled": True, "mode": "offline", "id": "ref-run"}
    run = _versions(out_dir, wandb_cfg, [4, 9])

    assert _staged(offline_wandb) == []  # no copy of any checkpoint under W&B's data dir
    for step, version in zip([4, 9], run["versions"]):
        path = out_dir / f"step{step:09d}.pt"
        assert version["refs"] == [path.resolve().as_uri()]
        assert version["metadata"]["checkpoint"] == {
            "path": str(path),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "size": path.stat().st_size,
        }
        assert version["metadata"]["step"] == step


@pytest.mark.slow
def test_uploaded_checkpoint_copies_are_pruned_to_keep_last_k(offline_wandb):
    out_dir = offline_wandb / "run"
    wandb_cfg = {"enabled": True, "mode": "offline", "id": "up-run", "upload_checkpoints": True}
    run = _versions(out_dir, wandb_cfg, [1, 2, 3, 4], train={"keep_last_k": 2})

    assert [files for _, _, files in run["artifacts"]] == [
        [f"step{step:09d}.pt"] for step in [1, 2, 3, 4]
    ]
    assert all(version["refs"] == [""] for version in run["versions"])  # copies, not references
    staged = {path.read_bytes() for path in _staged(offline_wandb)}
    assert staged == {(out_dir / f"step{step:09d}.pt").read_bytes() for step in [3, 4]}


def test_upload_of_a_checkpoint_in_object_storage_is_refused_with_the_fix(offline_wandb):
    hooks = make_wandb_hooks(
        {"enabled": True, "mode": "offline", "id": "s3-run", "upload_checkpoints": True}
    )
    emit(hooks, "on_train_start", {"step": 0, "out_dir": str(offline_wandb), "resumed": False})
    info = {"step": 1, "path": "s3://bucket/run/step000000001.pt", "checkpoint": {}}
    with pytest.raises(ValueError, match="set wandb.upload_checkpoints: false"):
        hooks["on_checkpoint"][0](info)
    emit(hooks, "on_train_end", {"step": 1, "checkpoint": {}, "metrics": {}})


def test_runs_sharing_a_name_get_their_own_id_from_their_out_dir(tmp_path):
    wandb_cfg = {"name": "exp0", "resume": "allow", "project": "p"}
    first, second = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    assert wandb_run_id(wandb_cfg, first) != wandb_run_id(wandb_cfg, second)
    assert wandb_run_id(wandb_cfg, first) == wandb_run_id(wandb_cfg, f"{tmp_path}/runs/./a")
    assert wandb_run_id({**wandb_cfg, "id": "fixed"}, first) == "fixed"
    assert wandb_run_id({"name": "exp0"}, first) is None  # no resume: allow, no derived id


def _train_in_parts(out_dir: Path, wandb_cfg: dict) -> None:
    from koochak.loop import training_loop

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]

    def step_fn(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    training_loop(
        model=model,
        dataset=data,
        step_fn=step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_cfg={
            "max_steps": 3,
            "out_dir": str(out_dir),
            "device": "cpu",
            "checkpoint_parts": 2,
        },  # fmt: skip
        config_json={"wandb": wandb_cfg},
        hooks=make_wandb_hooks({"wandb": wandb_cfg}),
    )


@pytest.mark.slow
@pytest.mark.parametrize("upload", [False, True])
def test_a_checkpoint_in_parts_is_versioned_with_all_its_parts(offline_wandb, upload):
    out_dir = offline_wandb / "parts"
    wandb_cfg = {
        "enabled": True,
        "mode": "offline",
        "id": "parts-run",
        "upload_checkpoints": upload,
    }
    _train_in_parts(out_dir, wandb_cfg)
    run = _read_run(out_dir, "parts-run")
    name = "step000000003.pt"
    files = [name, f"{name}.part-00000-00000", f"{name}.part-00000-00001"]
    ((_, _, stored),) = run["artifacts"]
    assert sorted(stored) == files
    (version,) = run["versions"]
    if upload:
        assert sorted(p.read_bytes() for p in _staged(offline_wandb)) == sorted(
            (out_dir / f).read_bytes() for f in files
        )
    else:
        assert sorted(version["refs"]) == sorted((out_dir / f).resolve().as_uri() for f in files)
        assert _staged(offline_wandb) == []

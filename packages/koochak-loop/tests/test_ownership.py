"""One run, one owner (issue 35), end to end through koochak-train (``cli.main`` in-process, and
one live run as a subprocess): the lease on every tier before any marker, markers that keep runs
apart, ``--resume none`` making the new run the owner of a used out_dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from koochak.loop.checkpoint import resolve_auto_resume  # noqa: E402
from koochak.loop.checkpoint.export import main as export_main  # noqa: E402
from koochak.loop.checkpoint.retention import committed_names  # noqa: E402
from koochak.loop.checkpoint.tier_marker import MARKER_KEY, read_marker  # noqa: E402
from koochak.loop.cli import main  # noqa: E402
from koochak.storage.store import LocalStore  # noqa: E402
from tiny_project import user_code  # noqa: E402

STEP = """
def step_fn(model, batch, ctx):
    time.sleep(float(os.environ.get("KOOCHAK_TEST_STEP_SLEEP", "0")))
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user project in the working directory and its config (out_dir ``run``)."""
    name = f"ownpkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(user_code("import time\n" + STEP))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KOOCHAK_NODE_INDEX", raising=False)
    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(f"""
        train:
          max_steps: 6
          ckpt_every: 1
          device: cpu
          out_dir: {tmp_path / "run"}
          progress_bar: false
        optim:
          optimizer: {{name: sgd, lr: 0.05}}
        logging:
          stdout: false
        entry:
          model: {name}:make_model
          dataset: {name}:dataset
          step: {name}:step_fn
        """))  # fmt: skip
    return tmp_path, config


def _train(config, *overrides, resume="auto"):
    return main(["--config", str(config), *overrides, "--resume", resume])


def _steps(location) -> list[int]:
    return [int(name[4:13]) for name in committed_names(LocalStore(str(location)))]


def _files(*roots: Path) -> dict[str, bytes]:
    """Every file under ``roots`` and its bytes (symlinks as their target)."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")) if root.exists() else ():
            if path.is_symlink():
                found[str(path)] = os.readlink(path).encode()
            elif path.is_file():
                found[str(path)] = path.read_bytes()
    return found


# ------------------------------------------------------------------ defect 1: --resume none


def test_resume_none_in_a_used_out_dir_makes_the_new_run_its_owner(project, capsys, caplog):
    root, config = project
    run = root / "run"
    assert _train(config, "train.max_steps=10", "train.keep_last_k=2") == 0  # the older run
    older = _steps(run)
    assert older[0] == 10 and len(older) == 2
    old_run = resolve_auto_resume(run).checkpoint["run_id"]
    # The "different run" refusal's advice: start over in the same out_dir.
    assert _train(config, "train.max_steps=6", "train.keep_last_k=2", resume="none") == 0
    newer = _steps(run)
    assert newer[0] == 6 and len(newer) == 2  # the new run's: kept, not pruned as they commit
    assert os.path.realpath(run / "latest.pt") == str(run / "step000000006.pt")
    # Selection sees only the owner's: resume, and export's default step.
    found = resolve_auto_resume(run)
    assert found is not None and found.checkpoint["step"] == 6
    new = read_marker(LocalStore(str(run)))
    assert new is not None and new.run_id != old_run
    assert found.checkpoint["run_id"] == new.run_id
    capsys.readouterr()
    assert export_main([str(run), str(root / "export")]) == 0
    exported = torch.load(root / "export" / "model.pt", weights_only=True)
    expected = found.checkpoint["model"]
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    # The older run's checkpoints are neither selected nor deleted: moved aside, said in a line.
    aside = list((run / "superseded").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(old_run)
    assert _steps(aside[0]) == older
    assert any("moved to" in r.getMessage() and "step000000010.pt" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # And the new run resumes as itself (its own retry).
    assert _train(config, "train.max_steps=8", "train.keep_last_k=2") == 0
    assert _steps(run)[0] == 8
    assert resolve_auto_resume(run).checkpoint["run_id"] == new.run_id


def test_resume_none_that_supersedes_a_run_is_in_the_run_history_and_report(project):
    """The run's story says it started over: which run it superseded, in which tier, which
    checkpoints moved, and where to (a supersede event with the new attempt's number)."""
    from koochak.loop import report
    from koochak.loop.run_history import read_history

    root, config = project
    run = root / "run"
    assert _train(config, "train.max_steps=4", "train.keep_last_k=2") == 0  # the older run
    old_run = resolve_auto_resume(run).checkpoint["run_id"]
    assert _train(config, "train.max_steps=2", resume="none") == 0
    (aside,) = (run / "superseded").iterdir()
    history = read_history(run)
    (event,) = [r for r in history if r["event"] == "supersede"]
    (start,) = [r for r in history if r["event"] == "start" and r["attempt"] == event["attempt"]]
    moved = _steps(aside)
    assert (event["tier"], event["run_id"], event["steps"]) == (0, old_run, moved)
    assert event["path"] == str(aside) and start["step"] == 0 and start["resumed"] is False
    story = "\n".join(report.story_lines(report.gather_run(run)))
    steps = ", ".join(map(str, sorted(moved)))
    assert f"run {old_run}'s checkpoint(s) in tier 0 (step {steps}) moved aside to {aside}" in story


# ------------------------------------------------------------------ defect 3: markers


def test_a_markerless_replica_of_another_run_is_refused_not_adopted(project, capsys):
    root, config = project
    durable = root / "durable"
    replica = f"train.checkpoint_replicas=[{durable}]"
    assert _train(config, "train.max_steps=6", "train.keep_last_k=2", replica,
                  "train.run_id=run-x") == 0  # fmt: skip
    (durable / MARKER_KEY).unlink()  # a replica written before tier markers existed
    before = _files(durable)
    capsys.readouterr()
    code = _train(config, f"train.out_dir={root}/other", "train.max_steps=8",
                  "train.keep_last_k=2", replica, "train.run_id=run-y")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "run-x" in err and "train.checkpoint_replicas[0]" in err
    assert len(err.strip().splitlines()) == 1
    assert _files(durable) == before  # never adopted: nothing written or pruned
    assert not (root / "other" / "step000000001.pt").exists()


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_a_live_run_keeps_every_tier_against_a_second_launch(project, capsys, monkeypatch):
    """Run A is live between marking its tiers and its first commit (slow steps). A second
    submission of A (another node's {node} first tier, the same out_dir and replica) and a run B
    (another out_dir, the same replica) are both refused with exit 2, and leave every file as
    they found it; A then finishes with its own checkpoints."""
    root, config = project
    tiers = [
        f"train.checkpoint_dir={root}/local{{node}}",
        f"train.checkpoint_replicas=[{root}/durable]",
    ]
    env = dict(os.environ, KOOCHAK_NODE_INDEX="0", KOOCHAK_TEST_STEP_SLEEP="0.5")
    env.pop("KOOCHAK_TEST_STEP_SLEEP_B", None)
    live = subprocess.Popen(
        [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "train.max_steps=6",
         "train.ckpt_every=0", *tiers, "--resume", "auto"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(root / "durable" / MARKER_KEY, live)
        marker = read_marker(LocalStore(str(root / "durable")))
        roots = [root / "run", root / "local0", root / "local1", root / "durable", root / "b"]
        before = _files(*roots)
        capsys.readouterr()
        monkeypatch.setenv("KOOCHAK_NODE_INDEX", "1")  # the job submitted twice, on another node
        assert _train(config, *tiers) == 2
        err = capsys.readouterr().err
        assert "another run holds this location" in err and len(err.strip().splitlines()) == 1
        monkeypatch.setenv("KOOCHAK_NODE_INDEX", "0")
        assert _train(config, f"train.out_dir={root}/b", f"train.checkpoint_dir={root}/b",
                      f"train.checkpoint_replicas=[{root}/durable]") == 2  # fmt: skip
        err = capsys.readouterr().err
        assert "train.checkpoint_replicas[0]" in err and "another run holds" in err
        after = _files(*roots)
        renewals = [k for k in set(before) | set(after) if ".renewed-" in k]
        assert {k: v for k, v in after.items() if k not in renewals} == {
            k: v for k, v in before.items() if k not in renewals
        }  # a refused start changes nothing anywhere
        assert read_marker(LocalStore(str(root / "durable"))) == marker
        assert live.wait(timeout=120) == 0, live.communicate()[0]
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGKILL)
            live.wait()
    assert _steps(root / "durable") == [6]
    found = resolve_auto_resume(root / "durable")
    assert found.checkpoint["run_id"] == marker.run_id


# ------------------------------------------------------------------ defect 4: liveness


def test_a_live_run_on_another_machine_of_this_hostname_is_not_taken_over(project, capsys):
    """A lease whose host is this hostname but whose boot id is another's, renewed just now: a
    machine of the same name (a cloned image), not this one before a reboot. Refused, exit 2."""
    import json
    import socket
    import uuid

    root, config = project
    (root / "run").mkdir()
    record = {"version": 1, "token": uuid.uuid4().hex, "host": socket.gethostname(),
              "boot_id": str(uuid.uuid4()), "pid_ns": "pid:[1]", "pid": 4242, "pid_start": 7,
              "started": time.time() - 0.5, "ttl_seconds": 600.0, "purpose": "koochak run"}  # fmt: skip
    (root / "run" / "koochak-run.lease.json").write_text(json.dumps(record))
    before = _files(root / "run")
    capsys.readouterr()
    assert _train(config, "train.max_steps=2") == 2
    err = capsys.readouterr().err
    assert "another run holds this location" in err and "pid 4242" in err
    assert _files(root / "run") == before


# ------------------------------------------------------------------ defect 2: durability


def test_the_first_tier_stays_bounded_when_a_replica_keeps_fewer(project):
    """keep_last_k 2 in the first tier, 1 in the replica: a checkpoint the replica held and
    pruned since was durable, so the first tier prunes it too (it kept all 24 before)."""
    root, config = project
    replica = f"train.checkpoint_replicas=[{{location: '{root}/durable', keep_last_k: 1}}]"
    assert _train(config, "train.max_steps=24", "train.keep_last_k=2",
                  f"train.checkpoint_dir={root}/fast", replica) == 0  # fmt: skip
    first = _steps(root / "fast")
    assert first[0] == 24 and len(first) <= 3, first
    assert _steps(root / "durable") == [24]

"""Each attempt starts with a record in every sink; a finished run says so (issue 29, item 2)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from koochak.loop.cli import main
from koochak.loop.hooks import emit
from koochak.loop.logging import make_wandb_hooks, read_csv_log, read_jsonl_log
from koochak.loop.run_history import begin_attempt, read_history

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_project import user_code  # noqa: E402

USER_CODE = user_code(
    '''
def step_fn(model, batch, ctx):
    if ctx.step == int(os.environ.get("HISTORY_FAIL_AT", "-1")):
        raise RuntimeError("the node fell over")
    if ctx.step == int(os.environ.get("HISTORY_KILL_AT", "-1")):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no end record, no terminal checkpoint
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}
''',
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"historypkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            train:
              max_steps: 8
              log_every: 1
              ckpt_every: 2
              keep_last_k: null
              device: cpu
              out_dir: {tmp_path / "run"}
              progress_bar: false
            optim:
              optimizer: {{name: sgd, lr: 0.05}}
            entry:
              model: {name}:make_model
              dataset: {name}:dataset
              step: {name}:step_fn
            """
        )
    )
    return tmp_path, config


def test_a_resumed_attempt_starts_with_its_record_in_every_sink(project, capsys, monkeypatch):
    root, config = project
    run = root / "run"
    monkeypatch.setenv("HISTORY_FAIL_AT", "5")
    assert main(["--config", str(config), "--resume", "none"]) == 1
    capsys.readouterr()
    monkeypatch.delenv("HISTORY_FAIL_AT")
    assert main(["--config", str(config), "logging.tensorboard=true"]) == 0
    out, err = capsys.readouterr()

    # stdout: the start line carries the record
    (start,) = [line for line in out.splitlines() if line.startswith("start\t")]
    fields = dict(f.split("=", 1) for f in start.split("\t")[1:])
    assert fields["attempt"] == "2" and fields["step"] == "4" and fields["resumed_tier"] == "0"
    assert fields["resumed_from"].endswith("step000000003.pt")
    assert fields["previous_end"] == "failed" and fields["steps_redone"] == "1"
    # stderr: one line says which checkpoint, which tier, and why
    (said,) = [line for line in err.splitlines() if "attempt 2: resuming from" in line]
    assert "(tier 0) at step 4 of 8" in said and "failed after step 5" in said
    assert "RuntimeError: the node fell over" in said and "1 step(s) redone" in said
    assert [line for line in err.splitlines() if "useful step(s)" in line]

    # JSONL: the whole record, between the attempts' rows
    records = read_jsonl_log(run / "log.jsonl")
    attempts = [r for r in records if r["event"] == "attempt"]
    assert [(r["step"], r["metrics"]["attempt"]) for r in attempts] == [(0, 1), (4, 2)]
    second = attempts[1]["metrics"]
    assert second["previous_end"] == "failed" and second["previous_step"] == 5
    assert second["steps_redone"] == 1 and second["resumed_tier"] == 0
    order = [(r["event"], r["step"]) for r in records]
    at = order.index(("attempt", 4))
    assert order[at - 1] == ("log", 4) and order[at + 1] == ("log", 4)  # step 4 again, after it
    (end,) = [r for r in records if r["event"] == "end"]
    assert end["step"] == 8 and end["metrics"]["attempts"] == 2
    assert end["metrics"]["useful_steps"] == 8 and 0 < end["metrics"]["goodput"] <= 1

    # CSV: two readable columns, attempt and note; every logged row has its throughput
    rows = read_csv_log(run / "log.csv")
    logged = [r["metrics"] for r in rows if r["event"] == "log"]
    assert [m["progress"] for m in logged][-1] == 1.0 and all("eta_s" in m for m in logged)
    assert [line for line in out.splitlines() if "progress=8/8" in line and "eta=" in line]
    assert all(m["mfu"] > 0 for m in logged)  # measured FLOPs over the CPU's measured peak
    csv_attempts = [r for r in rows if r["event"] == "attempt"]
    assert [set(r["metrics"]) for r in csv_attempts] == [{"attempt", "note"}] * 2
    assert csv_attempts[1]["metrics"]["note"] == said.split("koochak: ", 1)[1]
    header = (run / "log.csv").read_text().splitlines()[0].split(",")
    assert header[:6] == ["version", "event", "step", "time", "attempt", "note"]

    # TensorBoard: the note as text, the number as a scalar
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("attempt")] == [(4, 2.0)]
    (text,) = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("attempt/text_summary")]
    assert "attempt 2: resuming from" in text

    history = read_history(run)
    story = [(r["event"], r["attempt"], r.get("step")) for r in history
             if r["event"] != "progress"]  # fmt: skip
    assert story == [("start", 1, 0), ("commit", 1, 1), ("commit", 1, 3), ("end", 1, 5),
                     ("resume", 2, 3), ("start", 2, 4), ("commit", 2, 5), ("commit", 2, 8),
                     ("end", 2, 8)]  # fmt: skip
    assert {r["version"] for r in history if r["event"] == "commit"} == {2}
    assert {r["tier"] for r in history if r["event"] == "commit"} == {0}
    (start,) = [r for r in history if r["event"] == "start" and r["attempt"] == 2]
    assert start["previous"] == {"end": "failed", "step": 5, "steps_redone": 1,
                                 "steps_redone_exact": True}  # fmt: skip
    assert start["world_size"] == 1 and list(start["hosts"].values()) == [[0]]

    # Once more on the finished run: one line says there is nothing to train.
    assert main(["--config", str(config)]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "already finished" in line]
    assert len(said) == 1 and "at step 8 of 8" in said[0] and "nothing to train" in said[0]
    assert len(read_history(run)) == len(history)  # a no-op is no attempt


def test_a_killed_attempt_is_a_crash_after_its_last_logged_step(tmp_path):
    lines = [{"version": 1, "event": "start", "attempt": 1, "time": 1.0, "step": 0},
             {"version": 1, "event": "progress", "attempt": 1, "time": 2.0, "step": 7}]  # fmt: skip
    (tmp_path / "attempts.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + '{"torn'
    )
    checkpoint = {"step": 4, "next_step": 5, "reason": "periodic"}
    record = begin_attempt(tmp_path, [str(tmp_path / "ck"), "s3://b/r"],
                           "s3://b/r/step000000004.pt", checkpoint, 5, 10)  # fmt: skip
    assert record["attempt"] == 2 and record["resumed_tier"] == 1
    assert record["previous_end"] == "crashed" and record["steps_redone"] == 2
    # no end record: the last step logged is a lower bound of what the attempt did (issue 37)
    assert record["steps_redone_exact"] is False and record["previous_step"] == 7
    assert "crashed or was killed after step 7 or later" in record["note"]
    assert "at least 2 step(s) redone" in record["note"]
    evacuated = begin_attempt(tmp_path / "none", [str(tmp_path)], str(tmp_path / "step.pt"),
                              {"reason": "evacuation"}, 5, 10)  # fmt: skip
    assert evacuated["previous_end"] == "evacuated" and evacuated["attempt"] == 2


def test_wandb_gets_the_attempt_record_and_the_goodput(tmp_path, monkeypatch):
    runs = []

    class Run:
        id = "r1"

        def __init__(self):
            self.summary, self.rows = {}, []
            runs.append(self)

        def log(self, row, step):
            self.rows.append((step, row))

        def finish(self, exit_code=0):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Settings=dict)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    hooks = make_wandb_hooks({"wandb": {"enabled": True, "mode": "offline", "name": "x",
                                        "resume": "allow", "dir": str(tmp_path)}})  # fmt: skip
    attempt = {"attempt": 2, "start_step": 4, "note": "attempt 2: ...", "previous_end": "failed"}
    emit(hooks, "on_train_start", {"step": 4, "resumed": True, "attempt": attempt,
                                   "out_dir": str(tmp_path)})  # fmt: skip
    emit(hooks, "on_log", {"step": 4, "metrics": {"loss": 1.0, "progress": "5/8"}})
    emit(hooks, "on_train_end", {"step": 8, "run": {"goodput": 0.5, "attempts": 2}})
    (run,) = runs
    assert run.summary["attempt"] == 2 and run.summary["attempts/2"]["previous_end"] == "failed"
    assert run.summary["goodput"] == 0.5 and run.rows == [(4, {"loss": 1.0})]


def test_goodput_counts_from_the_latest_fresh_start():
    from koochak.loop.run_history import goodput

    records = [{"event": "start", "attempt": 1, "time": 0.0, "step": 0, "resumed": False},
               {"event": "end", "attempt": 1, "time": 50.0, "step": 10},
               {"event": "start", "attempt": 2, "time": 100.0, "step": 0, "resumed": False},
               {"event": "start", "attempt": 3, "time": 140.0, "step": 4, "resumed": True}]  # fmt: skip
    run = goodput(records, step=10, wall_time=30.0, now=160.0)
    assert run["attempts"] == 2 and run["useful_steps"] == 10 and run["wall_s"] == 60.0
    assert run["goodput"] == 0.5 and run["goodput_steps_per_s"] == pytest.approx(10 / 60)


@pytest.mark.slow
def test_kill_9_then_resume_says_crashed_after_the_last_logged_step(project):
    root, config = project
    cmd = [sys.executable, "-m", "koochak.loop.cli", "--config", str(config)]
    env = {**os.environ, "HISTORY_KILL_AT": "5", "PYTHONPATH": str(root)}
    killed = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    env.pop("HISTORY_KILL_AT")
    resumed = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (said,) = [line for line in resumed.stderr.splitlines() if "attempt 2: resuming" in line]
    assert "(tier 0) at step 4 of 8" in said and "killed after step 5 or later" in said
    assert "at least 1 step(s) redone" in said
    attempt = [r for r in read_jsonl_log(root / "run" / "log.jsonl") if r["event"] == "attempt"]
    assert attempt[-1]["metrics"]["previous_end"] == "crashed"


HOSTILE = [
    '{"version": 1, "event": "start", "attempt": "x", "time": 1.0, "step": 0}',  # wrong type
    "[1, 2]",
    '{"version": 1, "event": "progress", "attempt": 1, "time": "soon", "step": 3}',
    '{"version": 1, "event": "end", "attempt": true, "time": 2.0, "step": 3}',
    '{"version": 1, "event": "start", "attempt": 1, "time": 1e999, "step": 0}',
    '{"version": 1, "event": "start", "attempt": 1, "time": 1.0, "step": -4}',
    '{"version": 1, "event": "start", "attempt": 1, "time": 1.0, "step": 0, "hosts": "h"}',
    '{"version": 2, "event": "commit", "attempt": 1, "time": 1.0, "tier": "0", "step": 2}',
    '{"version": 2, "event": "replicate", "attempt": 1, "tier": 1, "step": 2}',  # no time
    '{"version": 1, "event": 7, "attempt": 1, "time": 1.0}',
    '{"version": 9, "event": "start", "attempt": 1, "time": 1.0, "step": 0}',  # a newer format
    '{"version": 1, "event": "start", "attempt": 1, "time": 1.0, "step": 0, "hosts": {"h": [0]}}',
    '{"version": 2, "event": "future-event", "attempt": 1, "time": 1.0, "shape": [1]}',
    '{"torn',
]


def test_hostile_or_torn_history_lines_are_skipped_with_one_warning(project, capsys):
    root, config = project
    run = root / "run"
    run.mkdir()
    (run / "attempts.jsonl").write_text("\n".join(HOSTILE) + "\n")
    records = read_history(run)
    assert [(r["event"], r["version"]) for r in records] == [("start", 1), ("future-event", 2)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(run / "attempts.jsonl") in err[0], err
    assert "11 torn or malformed line(s) skipped (the first: line 1)" in err[0]
    assert "1 line(s) of a newer history version skipped" in err[0]
    assert main(["--config", str(config), "--resume", "none"]) == 0  # the next attempt starts
    err = capsys.readouterr().err
    assert "torn or malformed" in err and "Traceback" not in err
    from koochak.loop import report_cli

    assert report_cli.main([str(run)]) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err


def test_the_resume_selection_records_the_candidates_passed_over_and_why(project, capsys):
    root, config = project
    run = root / "run"
    assert main(["--config", str(config), "--resume", "none"]) == 0
    newest = run / "step000000008.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # torn: its manifest's size no longer holds
    assert main(["--config", str(config), "train.max_steps=10"]) == 0
    (chosen,) = [r for r in read_history(run) if r["event"] == "resume"]
    assert chosen["version"] == 2 and chosen["attempt"] == 2
    assert (chosen["tier"], chosen["step"]) == (0, 5)  # the first attempt saved 1, 3, 5 and 8
    assert chosen["path"].endswith("step000000005.pt")
    (passed,) = chosen["passed_over"]
    assert (passed["tier"], passed["step"]) == (0, 8) and "manifest says" in passed["why"]
    (start,) = [r for r in read_history(run) if r["event"] == "start" and r["attempt"] == 2]
    assert start["previous"]["end"] == "finished" and start["previous"]["steps_redone"] == 2


def test_a_killed_attempts_lost_node_and_requeue_are_told_from_slurm(tmp_path, monkeypatch):
    """The previous attempt (job 77 on node1 and node2) left no end record; Slurm says node2's
    slurmd started after that attempt began and the job was requeued once. (scontrol is a
    stand-in printing what Slurm prints: a node cannot be lost on this machine's Slurm.)"""
    began = 1796000000.0
    after = datetime.datetime.fromtimestamp(began + 60).strftime("%Y-%m-%dT%H:%M:%S")
    before = datetime.datetime.fromtimestamp(began - 60).strftime("%Y-%m-%dT%H:%M:%S")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$2 $3" in
          "job 77") echo "JobId=77 JobName=x JobState=CANCELLED Reason=None Restarts=1" ;;
          "node node1") echo "NodeName=node1 State=IDLE SlurmdStartTime={before}" ;;
          "node node2") echo "NodeName=node2 State=IDLE SlurmdStartTime={after}" ;;
          *) exit 1 ;;
        esac
        """))  # fmt: skip
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    start = {"version": 1, "event": "start", "attempt": 1, "time": began, "step": 0,
             "hosts": {"node1": [0], "node2": [1]}, "slurm_job_id": "77",
             "slurm_restarts": 0}  # fmt: skip
    progress = {"version": 1, "event": "progress", "attempt": 1, "time": began + 9, "step": 9}
    (tmp_path / "attempts.jsonl").write_text(json.dumps(start) + "\n" + json.dumps(progress) + "\n")
    record = begin_attempt(tmp_path, ["/local/x", "s3://b/x"], "s3://b/x/step000000008.pt",
                           {"step": 8, "next_step": 9, "reason": "periodic"}, 9, 20)  # fmt: skip
    assert record["previous_end"] == "node_lost" and record["previous_requeued"] == 1
    assert record["previous_failure"] == ("node2 lost: rank 1 never ended (its slurmd restarted "
                                          "after the attempt began); requeued by Slurm")  # fmt: skip
    assert "the previous attempt ended after step 9 or later: node2 lost" in record["note"]
    assert record["resumed_tier"] == 1


def test_prunes_of_a_run_without_replicas_are_in_the_history(project):
    root, config = project
    assert main(["--config", str(config), "--resume", "none", "train.keep_last_k=2"]) == 0
    history = read_history(root / "run")
    pruned = [s for r in history if r["event"] == "prune" for s in r["steps"]]
    assert pruned == [1, 3] and {r["tier"] for r in history if r["event"] == "prune"} == {0}
    assert [r["step"] for r in history if r["event"] == "commit"] == [1, 3, 5, 8]

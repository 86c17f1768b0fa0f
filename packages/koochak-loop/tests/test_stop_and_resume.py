"""Ending a run from a hook (StopTraining), resuming with a changed config, and what an
evacuation tells the person watching."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.checkpoint import resolve_auto_resume
from koochak.loop.config import ConfigError
from koochak.loop.evacuation import Evacuated, EvacuationController
from koochak.loop.hooks import StopTraining, merge
from koochak.loop.logging import make_csv_hooks, read_csv_log


def _data(n: int = 12):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _step_fn(model, batch, ctx):
    return {"loss": torch.nn.functional.mse_loss(model(batch[0]), batch[1])}


def _eval_fn(model, data, ctx):
    return {"loss": sum(float(_step_fn(model, b, ctx)["loss"]) for b in data) / len(data)}


def _run(out_dir, hooks=None, **train):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    cfg = {"max_steps": 12, "log_every": 2, "eval_every": 2, "device": "cpu",
           "out_dir": str(out_dir), **train}  # fmt: skip
    return training_loop(model=model, dataset=_data(), step_fn=_step_fn,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_cfg=cfg,
                         eval_dataset=_data(2), eval_fn=_eval_fn, hooks=hooks, resume="auto")  # fmt: skip


def test_a_hook_ends_the_run_normally_with_a_stopped_checkpoint(tmp_path, capsys):
    evals, ended = [], []

    def early_stop(info):
        evals.append(info["step"])
        if len(evals) == 2:
            raise StopTraining("eval_loss: no better for 1 evaluation")

    # The early-stopping hook first: the CSV sink after it must still see the eval it stopped on.
    hooks = merge(
        {"on_eval_end": [early_stop], "on_train_end": [ended.append]},
        make_csv_hooks(tmp_path / "log.csv"),
    )
    checkpoint = _run(tmp_path, hooks)

    assert (checkpoint["step"], checkpoint["next_step"], checkpoint["reason"]) == (4, 4, "stopped")
    assert evals == [1, 3]  # the update that asked completed; nothing ran after it
    assert ended[0]["reason"] == "stopped"
    assert ended[0]["stop_reason"] == "eval_loss: no better for 1 evaluation"
    assert "koochak: stopped at step 4 (eval_loss: no better" in capsys.readouterr().out
    # The other hooks of that event still ran: the eval row that triggered the stop is logged.
    rows = [(r["event"], r["step"]) for r in read_csv_log(tmp_path / "log.csv")]
    assert [row for row in rows if row[0] in ("log", "eval")][-1] == ("eval", 3)
    assert rows[-1] == ("end", 4)  # the attempt's goodput record closes it
    path, found = resolve_auto_resume(tmp_path)
    assert path.endswith("step000000004.pt") and found["reason"] == "stopped"

    # Rerunning the same command resumes a run that is over: it trains no further.
    again = _run(tmp_path, {"on_eval_end": [early_stop]})
    assert (again["step"], again["reason"]) == (4, "stopped") and evals == [1, 3]


def test_sys_exit_in_a_hook_is_a_failure_the_hooks_hear_of(tmp_path):
    failures = []

    def leave(info):
        if info["step"] == 3:
            sys.exit(0)

    with pytest.raises(SystemExit):
        _run(tmp_path, {"on_step_end": [leave], "on_exception": [failures.append]})
    assert [type(f["exception"]) for f in failures] == [SystemExit]
    assert resolve_auto_resume(tmp_path) is None  # no terminal checkpoint claims the run ended


def test_stop_from_on_log_and_on_step_end_too(tmp_path):
    def budget(info):
        if info["step"] >= 5:  # on_step_end sees every update, on_log every second one
            raise StopTraining("step budget")

    assert _run(tmp_path / "a", {"on_step_end": [budget]}, eval_every=None)["step"] == 6
    assert _run(tmp_path / "b", {"on_log": [budget]}, eval_every=None)["step"] == 6


def test_a_resume_that_changes_the_run_is_refused_with_the_fix(tmp_path):
    _run(tmp_path, max_steps=6)
    with pytest.raises(ConfigError) as caught:
        _run(tmp_path, max_steps=12, grad_accum=2, grad_clip=1.0)
    message = str(caught.value)
    assert "train.grad_accum: 1 -> 2" in message and "train.grad_clip: None -> 1.0" in message
    assert message.endswith("train.resume_allow_changes=[train.grad_accum,train.grad_clip]")
    # The override accepts exactly these; the longer max_steps is harmless and said once.
    with pytest.warns(UserWarning, match=r"train.max_steps: 6 -> 12") as seen:
        checkpoint = _run(tmp_path, max_steps=12, grad_accum=2, grad_clip=1.0,
                          resume_allow_changes=["train.grad_accum", "train.grad_clip"])  # fmt: skip
    assert checkpoint["step"] == 12
    assert len([w for w in seen if "config changed since" in str(w.message)]) == 1


def test_evacuation_says_where_it_stopped_and_how_to_go_on(tmp_path, capsys):
    controller = EvacuationController()
    controller.request()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(Evacuated):
        training_loop(model=model, dataset=_data(), step_fn=_step_fn,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_cfg={"max_steps": 12, "device": "cpu", "out_dir": str(tmp_path)},
                      evacuation=controller)  # fmt: skip
    err = capsys.readouterr().err
    assert "koochak: evacuated after step 1: terminal checkpoint " in err
    assert str(tmp_path / "step000000001.pt") in err and "Rerun the same command" in err


@pytest.mark.slow
def test_koochak_train_refuses_a_changed_resume_with_exit_2_and_stops_with_exit_0(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "train: {max_steps: 6, log_every: 2, eval_every: 2, device: cpu, out_dir: "
        f"{tmp_path / 'run'}, progress_bar: false}}\n"
        "data: {batch_size: 4}\n"
        "entry: {model: tests_stop_entry:make_model, dataset: tests_stop_entry:dataset, "
        "step: tests_stop_entry:step_fn}\n"
    )
    (tmp_path / "tests_stop_entry.py").write_text(
        "import torch\n"
        "def make_model(cfg):\n    torch.manual_seed(0)\n    return torch.nn.Linear(2, 1)\n"
        "def dataset(cfg):\n    return [(torch.ones(cfg.data.batch_size, 2), torch.zeros(cfg.data.batch_size, 1))] * 20\n"
        "def step_fn(model, batch, ctx):\n"
        "    return {'loss': torch.nn.functional.mse_loss(model(batch[0]), batch[1])}\n"
    )

    def train(*overrides):
        return subprocess.run([sys.executable, "-m", "koochak.loop.cli", "--config", str(cfg),
                               *overrides], capture_output=True, text=True, cwd=tmp_path,
                              timeout=180)  # fmt: skip

    assert train().returncode == 0
    refused = train("train.max_steps=12", "data.batch_size=8", "optim.optimizer.lr=0.003")
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("koochak-train: error: resume from ")
    assert "data.batch_size: 4 -> 8; optim.optimizer.lr: 0.001 -> 0.003" in line
    assert line.endswith("train.resume_allow_changes=[data.batch_size,optim.optimizer.lr]")
    extended = train("train.max_steps=12")
    assert extended.returncode == 0, extended.stderr
    assert "train.max_steps: 6 -> 12" in extended.stderr


@pytest.mark.parametrize("parts", [1, 2])
def test_keep_best_k_never_prunes_the_best_checkpoint(tmp_path, parts):
    from koochak.storage.artifact import published_candidates
    from koochak.storage.store import open_store

    losses = iter([5.0, 1.0, 4.0, 3.0, 6.0, 7.0, 8.0, 2.5, 9.0, 9.5, 9.9, 9.8])

    def eval_fn(model, data, ctx):
        return {"loss": next(losses)}

    def names():
        return sorted(name for _, name in published_candidates(open_store(str(tmp_path)),
                                                               r"step(\d{9})\.pt"))  # fmt: skip

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    cfg = {"max_steps": 12, "eval_every": 1, "ckpt_every": 1, "keep_last_k": 2, "device": "cpu",
           "out_dir": str(tmp_path), "keep_best_k": 2, "keep_best_metric": "eval_loss",
           "checkpoint_parts": parts}  # fmt: skip
    training_loop(model=model, dataset=_data(), step_fn=_step_fn,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_cfg=cfg,
                  eval_dataset=_data(1), eval_fn=eval_fn)  # fmt: skip
    # The two newest (10, 12: the terminal one) and the two best: step 1 (1.0), step 7 (2.5).
    assert names() == ["step000000001.pt", "step000000007.pt", "step000000010.pt",
                       "step000000012.pt"]  # fmt: skip
    # Pruned checkpoints in parts leave no part behind; the kept ones keep theirs.
    kept_parts = {p.name.split(".part-")[0] for p in tmp_path.glob("step*.pt.part-*")}
    assert kept_parts == (set(names()) if parts > 1 else set())


def test_keep_best_k_needs_a_metric():
    from koochak.loop.config import load_config

    with pytest.raises(ConfigError, match="train.keep_best_k=2 needs train.keep_best_metric"):
        load_config(None, ["train.keep_best_k=2"])

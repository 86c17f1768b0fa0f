"""Logged metrics under DDP are the run's: two real gloo ranks log the mean over ranks (eval
weighted by each rank's batches), one gather per logging step; a metric can opt out. This file
is also the per-rank script (launched by ``python -m koochak.loop.launch``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _rank_main(out_dir: str, exclude: str) -> None:
    from koochak.loop import training_loop
    from koochak.loop.dist import exit_distributed_process, get_rank

    model = torch.nn.Linear(1, 1)
    gathers = []
    import koochak.loop.metric_reduction as reduction

    original = reduction._gather
    reduction._gather = lambda values, device: (
        gathers.append(len(values)) or original(values, device)
    )

    def step_fn(model, batch, ctx):  # rank r's loss is r + 1 (+ a term that trains the model)
        out = model(batch).mean() * 0.0
        return {"loss": out + float(ctx.rank + 1), "rank_seen": torch.tensor(float(ctx.rank))}

    def eval_fn(model, data, ctx):  # each rank's mean over its own shard of the eval set
        values = [float(b) for b in data]
        return {"value": sum(values) / len(values)}

    logged = []
    hooks = {"on_log": [lambda info: logged.append(("log", info["step"], info["metrics"]))],
             "on_eval_end": [lambda info: logged.append(("eval", info["step"], info["metrics"]))]}  # fmt: skip
    training_loop(
        model=model,
        dataset=[torch.ones(2, 1)] * 4,
        step_fn=step_fn,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_cfg={
            "max_steps": 4,
            "log_every": 2,
            "eval_every": 4,
            "device": "cpu",
            "out_dir": out_dir,
            "ddp": True,
            "warn_unsharded": False,
            "shard_eval_dataset": True,
            "shard_eval_dataset_mode": "map",
            "reduce_metrics_exclude": [exclude] if exclude else [],
        },  # fmt: skip
        eval_dataset=[1.0, 2.0, 3.0, 4.0, 10.0],  # rank 0: 1, 3, 10; rank 1: 2, 4
        eval_fn=eval_fn,
        hooks=hooks,
    )
    if get_rank() == 0:
        Path(out_dir, "logged.json").write_text(json.dumps({"logged": logged, "gathers": gathers}))
    exit_distributed_process(0)


def _launch(tmp_path, exclude: str = "") -> dict:
    cmd = [sys.executable, "-m", "koochak.loop.launch", "--standalone", "--nproc-per-node=2",
           __file__, str(tmp_path), exclude]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((tmp_path / "logged.json").read_text())


@pytest.mark.slow
def test_two_ranks_log_the_mean_over_ranks_in_one_gather_per_logging_step(tmp_path):
    result = _launch(tmp_path / "a")
    logs = [metrics for kind, _, metrics in result["logged"] if kind == "log"]
    assert [m["loss"] for m in logs] == [1.5, 1.5]  # (1 + 2) / 2, not rank 0's 1
    assert [m["rank_seen"] for m in logs] == [0.5, 0.5]
    assert all(m["step_time_s_max"] >= m["step_time_s_min"] for m in logs)
    (evaluation,) = [metrics for kind, _, metrics in result["logged"] if kind == "eval"]
    # Weighted by batches: rank 0 saw 3 (mean 14/3), rank 1 saw 2 (mean 3): the whole set's mean
    # is 20 / 5 = 4, where the plain mean of the two rank means would be 3.83.
    assert evaluation["eval_value"] == pytest.approx(4.0)
    # One gather per logging step (2) and one per evaluation (1); nothing on other steps.
    assert len(result["gathers"]) == 3

    opted_out = _launch(tmp_path / "b", exclude="loss")
    logs = [metrics for kind, _, metrics in opted_out["logged"] if kind == "log"]
    assert [m["loss"] for m in logs] == [1.0, 1.0] and logs[0]["rank_seen"] == 0.5


def test_eval_metrics_are_weighted_by_each_ranks_batches(monkeypatch):
    import koochak.loop.metric_reduction as reduction

    rows = [[3.0, 3.0 * 2.0], [1.0, 1.0 * 6.0]]  # rank 0: 3 batches, mean 2; rank 1: 1, mean 6
    monkeypatch.setattr(reduction, "_gather", lambda values, device: rows)
    assert reduction.reduce_eval({"eval_loss": 2.0}, 3) == {"eval_loss": 3.0}  # (6 + 6) / 4
    assert reduction.reduce_eval({"eval_loss": 2.0}, 3, exclude={"eval_loss"}) == {"eval_loss": 2.0}


def test_a_single_process_is_left_alone():
    from koochak.loop.metric_reduction import CountedBatches, reduce_logged

    assert reduce_logged({"loss": 2.0, "lr": 0.1}, 0.5) == ({"loss": 2.0, "lr": 0.1}, [0.5])
    counted = CountedBatches([1, 2, 3])
    assert list(counted) == [1, 2, 3] and counted.count == 3 and len(counted) == 3


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")

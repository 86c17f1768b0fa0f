"""Bit-identical resume with everything on: logging every few updates (so the MFU column's CPU
probe runs in every attempt), eval, EMA, the run history, a DataLoader with workers and
per-sample augmentation. Each run is killed with SIGKILL at two points and resumed.

This file is also the script the tests launch: ``python test_resume_exact.py MODE OUT KILL_AT``
(MODE ``digits``: the quick start; ``dropout``: a dropout model fed by a DataLoader over an
``elastic_sampler`` with one worker, augmentation drawn from ``sample_generator``). The script
SIGKILLs itself inside update ``KILL_AT`` (-1: never), after its last checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = 40


def _killer(step_fn, kill_at):
    def step(model, batch, ctx):
        if ctx.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return step_fn(model, batch, ctx)

    return step


def run_digits(out_dir: str, kill_at: int) -> None:
    sys.path.insert(0, ROOT)
    from examples.digits import main as digits

    digits.step_fn = _killer(digits.step_fn, kill_at)
    digits.main([f"train.out_dir={out_dir}", f"train.max_steps={STEPS}", "train.log_every=3",
                 "train.eval_every=7", "train.ckpt_every=10", "train.device=cpu",
                 "optim.scheduler.warmup_steps=5", "logging.stdout=false"])  # fmt: skip


class _Noisy(torch.utils.data.Dataset):
    """x: fixed features plus per-sample noise from the sample's own generator (the item is the
    ``(SampleKey, index)`` pair that ``elastic_sampler(keys=True)`` hands out)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(96, 8, generator=g)
        self.y = (self.x.sum(dim=1, keepdim=True) > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, item):
        from koochak.loop.seed import sample_generator

        key, index = item
        noise = torch.randn(8, generator=sample_generator(3, *key)) * 0.1
        return self.x[index] + noise, self.y[index]


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)}


def _eval(model, data, ctx):
    return {"loss": float(sum(float(_step(model, b, ctx)["loss"]) for b in data))}


def run_dropout(out_dir: str, kill_at: int) -> None:
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.loop.elastic import elastic_sampler
    from koochak.loop.logging.jsonl import make_jsonl_hooks
    from koochak.loop.seed import set_all_seeds

    set_all_seeds(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = _Noisy()
    loader = torch.utils.data.DataLoader(
        data,
        batch_sampler=elastic_sampler(len(data), global_batch=16, keys=True, lanes=4),
        num_workers=1,
    )
    found = resolve_auto_resume(out_dir)
    training_loop(
        model=model,
        dataset=loader,
        step_fn=_killer(_step, kill_at),
        optimizer=optimizer,
        eval_dataset=[(data.x[:32], data.y[:32])],
        eval_fn=_eval,
        hooks=make_jsonl_hooks(os.path.join(out_dir, "log.jsonl")),
        train_cfg={
            "max_steps": STEPS,
            "log_every": 3,
            "eval_every": 7,
            "ckpt_every": 10,
            "device": "cpu",
            "out_dir": out_dir,
            "progress_bar": False,
            "ema": {"enabled": True, "decay": 0.9},
        },
        resume="auto",
        checkpoint_dict=found[1] if found else None,
        auto_resume_path=found[0] if found else None,
    )


def _launch(mode: str, out_dir, kill_at: int) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, __file__, mode, str(out_dir), str(kill_at)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def _losses(out_dir) -> list[tuple[int, float]]:
    """(step, loss) of every logged training row; each row carries the MFU column."""
    from koochak.loop.logging.jsonl import read_jsonl_log

    rows = [r for r in read_jsonl_log(os.path.join(out_dir, "log.jsonl")) if r["event"] == "log"]
    assert rows and all("mfu" in r["metrics"] for r in rows), rows[:2]
    return [(r["step"], r["metrics"]["loss"]) for r in rows]


def _assert_same_final_state(reference, interrupted) -> None:
    from koochak.loop.checkpoint import load

    want = load(os.path.join(reference, f"step{STEPS:09d}.pt"))
    got = load(os.path.join(interrupted, f"step{STEPS:09d}.pt"))
    for key, tensor in want["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    for index, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            other = got["optimizer"]["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert want.get("ema") is None or all(
        torch.equal(a, b)
        for a, b in zip(
            want["ema"]["shadows"][0]["state_dict"].values(),
            got["ema"]["shadows"][0]["state_dict"].values(),
            strict=True,
        )
    )
    reference_losses = dict(_losses(reference))
    logged = _losses(interrupted)  # every attempt's rows, the redone updates' twice
    assert len(logged) > len(reference_losses)
    for step, loss in logged:
        assert loss == reference_losses[step], (step, loss, reference_losses[step])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["digits", "dropout"])
def test_killed_twice_and_resumed_run_is_bit_identical(tmp_path, mode):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    code, output = _launch(mode, reference, -1)
    assert code == 0, output
    # Killed inside update 15 (last checkpoint before it: next_step 10), then inside 27 (20).
    for kill_at in (15, 27):
        code, output = _launch(mode, interrupted, kill_at)
        assert code == -signal.SIGKILL, output
    code, output = _launch(mode, interrupted, -1)
    assert code == 0, output
    _assert_same_final_state(reference, interrupted)


if __name__ == "__main__":
    {"digits": run_digits, "dropout": run_dropout}[sys.argv[1]](sys.argv[2], int(sys.argv[3]))

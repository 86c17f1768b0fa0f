"""The headline guarantee: a run killed with SIGKILL (even mid-publication) and restarted with
auto-resume until done ends bit-identical to a run that was never interrupted.

This file is also the training script the test launches (``python test_kill_resume.py OUT ...``):
a tiny CPU model with dropout (torch RNG), NumPy and Python randomness in ``step_fn``, AdamW and a
schedule, dual power EMA shadows thinned to every second update, a checkpoint after every update and keep_last_k=2, so most of the run's wall time is
spent publishing and a random kill often lands inside a publication. Deterministic kills inside
the object write (or, for a run saving in parts in the background, inside a part's write) and
between object and manifest come from a store wrapper (``killtest://``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

MAX_STEPS = 30


def _batches(start: int):
    # The dataset is a pure function of the update index, so a resumed run rebuilds it from
    # checkpoint["next_step"] and sees exactly the batches the uninterrupted run saw.
    index = start
    while True:
        g = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(16, 8, generator=g)
        yield {"x": x, "y": (x.sum(dim=1, keepdim=True) > 0).float()}
        index += 1


def _step_fn(model, batch, ctx):
    noise = float(np.random.rand()) * 1e-3 + random.random() * 1e-3  # NumPy + Python RNG
    logits = model(batch["x"]) + noise
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["y"])
    return {"loss": loss}


def _killing_store(root: str, mode: str, step: int):
    """A LocalStore that SIGKILLs this process at a chosen point of one publication."""
    from koochak.storage.store import LocalStore

    name = f"step{step:09d}.pt"

    class KillingStore(LocalStore):
        def put(self, key, data, **expected):
            if mode == "object" and key == name:
                view = memoryview(b"".join(data))

                def half_then_die():
                    yield bytes(view[: len(view) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                    yield bytes(view[len(view) // 2 :])

                return super().put(key, half_then_die())
            if mode == "part" and key == f"{name}.part-00000-00001":
                view = memoryview(b"".join(bytes(chunk) for chunk in data))

                def half_of_a_part_then_die():
                    yield bytes(view[: len(view) // 2])
                    os.kill(os.getpid(), signal.SIGKILL)
                    yield bytes(view[len(view) // 2 :])

                return super().put(key, half_of_a_part_then_die(), **expected)
            if mode == "manifest" and key == name + ".ready.json":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().put(key, data, **expected)

    return KillingStore(root)


def main(out_dir: str, kill_mode: str, kill_step: int, parts: int = 1, background: bool = False):
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.loop.seed import set_all_seeds
    from koochak.storage.store import register_store

    os.makedirs(out_dir, exist_ok=True)
    register_store("killtest", lambda rest: _killing_store(out_dir, kill_mode, kill_step))
    location = "killtest://ckpt"

    set_all_seeds(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=MAX_STEPS)
    found = resolve_auto_resume(location)
    ckpt, path = (found[1], found[0]) if found else (None, None)
    start = ckpt["next_step"] if ckpt else 0
    print(f"START {start}", flush=True)
    training_loop(
        model=model,
        dataset=_batches(start),
        step_fn=_step_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        train_cfg={
            "max_steps": MAX_STEPS,
            "ckpt_every": 1,
            "keep_last_k": 2,
            "log_every": 1000,
            "device": "cpu",
            "out_dir": out_dir,
            "checkpoint_dir": location,
            "checkpoint_parts": parts,
            "checkpoint_async": background,
            "progress_bar": False,
            "ema": {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}, "update_every": 2},
        },
        resume="auto",
        checkpoint_dict=ckpt,
        auto_resume_path=path,
    )
    print("DONE", flush=True)


def _run(out_dir, kill_mode="none", kill_step=-1, kill_after=None, parts=1) -> tuple[int, str]:
    """Run the script; returns (exit code, stdout + stderr), stdout starting with "START n".
    ``parts`` above 1 saves in that many parts, in the background (checkpoint_async)."""
    cmd = [sys.executable, __file__, str(out_dir), kill_mode, str(kill_step), str(parts)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # "START n": imports are done, training is under way
    if kill_after is not None and first.startswith("START"):
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    rest, err = proc.communicate(timeout=120)
    return proc.wait(), first + rest + err


def _final_state(out_dir):
    from koochak.loop.checkpoint import load

    return load(os.path.join(out_dir, f"step{MAX_STEPS:09d}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("parts", [1, 3])
def test_sigkilled_run_resumes_to_a_bit_identical_result(tmp_path, parts):
    """With ``parts=3`` the interrupted run saves in parts, in the background, killed inside a
    part's write and before a manifest; it still ends bit-identical to the one-file reference."""
    reference = tmp_path / "reference"
    code, output = _run(reference)
    assert code == 0, output

    interrupted = tmp_path / "interrupted"
    first = "object" if parts == 1 else "part"
    kills = [(first, 5, None), ("manifest", 12, None), ("none", -1, random.uniform(0.05, 0.4))]
    starts = []
    for mode, step, after in kills:
        code, output = _run(interrupted, mode, step, after, parts=parts)
        starts.append(output.split()[1] if output.startswith("START") else output)
        if code == 0:
            break
        assert code == -signal.SIGKILL, output
    for _ in range(5):  # then restart until it finishes on its own
        code, output = _run(interrupted, parts=parts)
        starts.append(output.split()[1])
        if code == 0:
            break
    assert code == 0, output
    # The first kill lands inside step 5's object write, so the retry resumes at 5; the manifest
    # kill at 12 leaves 12's object unmanifested, so the retry resumes at 12.
    assert starts[:3] == ["0", "5", "12"], starts

    want, got = _final_state(reference), _final_state(interrupted)
    assert (got["step"], got["next_step"]) == (MAX_STEPS, MAX_STEPS)
    for key, tensor in want["model"].items():
        assert torch.equal(tensor, got["model"][key]), key
    for index, state in want["optimizer"]["state"].items():
        for name, value in state.items():
            other = got["optimizer"]["state"][index][name]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert want["scheduler"] == got["scheduler"]
    # The EMA shadows continue bit-exactly too (both of them, thinned updates included).
    assert (want["ema"]["step"], want["ema"]["updates"]) == (
        got["ema"]["step"],
        got["ema"]["updates"],
    )
    for ours, theirs in zip(want["ema"]["shadows"], got["ema"]["shadows"], strict=True):
        for key, tensor in ours["state_dict"].items():
            assert torch.equal(tensor, theirs["state_dict"][key]), key


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[4]) > 1)

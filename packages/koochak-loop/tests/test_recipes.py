"""The recipes under examples/recipes run as a user runs them (``koochak-train --config ...``),
are killed with SIGKILL mid-run, resumed by rerunning the same command, and end bit-identical to
an uninterrupted run: weights, the main optimizer and every ``state`` entry (issue 38)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from koochak.loop.checkpoint import load

ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parent
RECIPES = ROOT / "examples" / "recipes"
KILL_AT = 12  # the last periodic checkpoint before it is after update 9 (ckpt_every: 5)
# Logging only at the end: until issue 37's fix the CPU peak-FLOPs probe at the first logged row
# draws from the global RNG, which a resumed process would do at another update.
COMMON = ["train.log_every=1000", "entry.hooks=recipe_kill:hooks"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(
    config: str, out: Path, *overrides: str, ranks: int = 1, kill: bool = False,
    dump: Path | None = None,
) -> int:  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    env.pop("RECIPE_KILL_AT", None)
    env.pop("RECIPE_START_DUMP", None)
    if dump is not None:
        env["RECIPE_START_DUMP"] = str(dump)
    if kill:
        env["RECIPE_KILL_AT"] = str(KILL_AT)
    args = ["--config", str(RECIPES / config), f"train.out_dir={out}", *COMMON, *overrides]
    if ranks == 1:
        cmd = [sys.executable, "-m", "koochak.loop.cli", *args]
    else:
        cmd = [sys.executable, "-m", "koochak.loop.launch", f"--nproc_per_node={ranks}",
               f"--master_port={_port()}", "-m", "koochak.loop.cli", *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    killed = done.returncode in (-9, 137)  # SIGKILL: the process itself, or through the launcher
    if (done.returncode != 0 and not killed) or killed != kill:
        raise AssertionError(f"{config} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.returncode


def _tensors(tree, path=""):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _tensors(value, f"{path}/{i}")


def _assert_same_end(ref: Path, resumed: Path, steps: int = 40) -> None:
    a, b = (load(d / f"step{steps:09d}.pt") for d in (ref, resumed))
    for field in ("model", "optimizer", "user_state"):
        left, right = dict(_tensors(a.get(field))), dict(_tensors(b.get(field)))
        assert left.keys() == right.keys(), field
        for key in left:
            assert torch.equal(left[key], right[key]), f"{resumed}: {field}{key}"
    assert a.get("origin") == b.get("origin")


def _kill_and_resume(config: str, tmp: Path, *overrides: str, ranks: int = 1) -> None:
    _train(config, tmp / "ref", *overrides, ranks=ranks)
    _train(config, tmp / "run", *overrides, ranks=ranks, kill=True)
    assert not (tmp / "run" / f"step{40:09d}.pt").exists()
    _train(config, tmp / "run", *overrides, ranks=ranks)  # the same command: resumes (auto)
    _assert_same_end(tmp / "ref", tmp / "run")


@pytest.mark.slow
def test_single_process_recipes_resume_bit_identically_after_kill_9(tmp_path):
    for config in ("gan.yaml", "sam.yaml", "grad_transform.yaml"):
        _kill_and_resume(config, tmp_path / config)
    gan_end = load(tmp_path / "gan.yaml" / "run" / f"step{40:09d}.pt")
    assert sorted(gan_end["user_state"]["entries"]) == ["opt_d"]
    # Fine-tuning starts from the SAM run's weights; a resume of it does not load them again.
    source = tmp_path / "sam.yaml" / "ref"
    _kill_and_resume("finetune.yaml", tmp_path / "finetune", f"train.init_from={source}")
    origin = load(tmp_path / "finetune" / "run" / f"step{40:09d}.pt")["origin"]
    assert origin["path"].endswith("step000000040.pt") and len(origin["sha256"]) == 64


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train.ddp=true", "train.fsdp.enabled=true"])
def test_the_gan_recipe_resumes_bit_identically_on_two_gloo_ranks(tmp_path, mode):
    _kill_and_resume("gan.yaml", tmp_path, mode, ranks=2)


@pytest.mark.slow
def test_the_ddp_gan_needs_find_unused_parameters_for_gs_parameters_in_the_d_step(tmp_path):
    # Why gan.yaml sets the flag (docs/loop.md, "A second backward under DDP"): D's backward
    # reaches none of G's parameters, so without it DDP's reducer never finishes that reduction
    # and the G step's forward fails on every rank, naming exactly G's parameters.
    # (TORCH_DISTRIBUTED_DEBUG=DETAIL would name them, but crashes the gloo ranks with SIGSEGV
    # here: DDP names them by their index in model.parameters().)
    with pytest.raises(AssertionError) as failed:
        _train("gan.yaml", tmp_path, "train.ddp=true", "train.find_unused_parameters=false",
               "train.max_steps=2", "train.ckpt_every=null", ranks=2)  # fmt: skip
    error = str(failed.value)
    assert "Expected to have finished reduction in the prior iteration" in error
    from examples.recipes.gan import make_model

    names = [name for name, _ in make_model().named_parameters()]
    for rank in (0, 1):
        said = error.split(f"did not receive grad for rank {rank}: ")[1].split(" In addition")[0]
        assert [names[int(i)] for i in said.split()] == [
            "G.0.weight", "G.0.bias", "G.2.weight", "G.2.bias"
        ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train.ddp=true", "train.fsdp.enabled=true"])
def test_sam_and_a_fine_tune_from_it_on_two_gloo_ranks(tmp_path, mode):
    # SAM's update_fn (two backward passes per update, each reducing across ranks) trains, is
    # killed, and its resume ends bit-identical to the uninterrupted run.
    _kill_and_resume("sam.yaml", tmp_path / "sam", mode, ranks=2)
    # A fine-tune from that run's last checkpoint: every rank starts from the source's weights,
    # each having read them itself (recorded before DDP's broadcast; gathered under FSDP).
    source = load(tmp_path / "sam" / "ref" / f"step{40:09d}.pt")["model"]
    dump = tmp_path / "start"
    dump.mkdir()
    _train("finetune.yaml", tmp_path / "finetune", mode, "train.max_steps=6",
           f"train.init_from={tmp_path / 'sam' / 'ref'}", ranks=2, dump=dump)  # fmt: skip
    for rank in (0, 1):
        start = torch.load(dump / f"start-{rank}.pt", weights_only=True)
        assert start.keys() == source.keys(), rank
        for name, value in source.items():
            assert torch.equal(start[name], value), f"rank {rank}: {name}"
    assert load(tmp_path / "finetune" / f"step{6:09d}.pt")["origin"]["path"].endswith(
        "step000000040.pt"
    )


# The hand-written loop has no hooks: the process kills itself inside update KILL_AT's forward.
_OWN_LOOP = """
import os, signal, sys
import torch.nn.functional as F
real, calls = F.mse_loss, [0]
def mse(*args, **kwargs):
    calls[0] += 1
    if os.environ.get("RECIPE_KILL_AT") and calls[0] == int(os.environ["RECIPE_KILL_AT"]) + 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
F.mse_loss = mse
from examples.recipes.own_loop import main
main(sys.argv[1])
"""


@pytest.mark.slow
def test_your_own_loop_with_koochaks_checkpoints_resumes_bit_identically_after_kill_9(tmp_path):
    def run(out: Path, kill: bool = False) -> int:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("RECIPE_KILL_AT", None)
        if kill:
            env["RECIPE_KILL_AT"] = str(KILL_AT)
        cmd = [sys.executable, "-c", _OWN_LOOP, str(out)]
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == (-9 if kill else 0), done.stderr[-3000:]
        return done.returncode

    run(tmp_path / "ref")
    run(tmp_path / "run", kill=True)
    assert sorted(p.name for p in (tmp_path / "run").glob("step*.pt")) == [
        "step000000004.pt", "step000000009.pt"
    ]  # fmt: skip
    run(tmp_path / "run")
    _assert_same_end(tmp_path / "ref", tmp_path / "run")
    # The replica tier got the end too, and the user's scheduler rode in user_state.
    end = load(tmp_path / "run-replica" / "step000000040.pt")
    assert end["user_state"]["entries"]["sched"]["last_epoch"] == 40

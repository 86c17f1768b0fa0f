"""Checkpoints inside training_loop: async publication, evacuation, GPU health, auto-resume, CLI."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from koochak.loop.checkpoint import CheckpointPublishError, load, resolve_auto_resume
from koochak.loop.evacuation import EVACUATION_EXIT_CODE, Evacuated, EvacuationController
from koochak.loop.health import GPU_HEALTH_EXIT_CODE, GpuHealthWatchdog, GpuReading, GpuUnhealthy
from koochak.loop.loop import training_loop
from koochak.storage.store import LocalStore, register_store


def _batches(start: int, stop: int = 1000):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(1, keepdim=True)


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _run(out, *, max_steps=6, start=0, hooks=None, step_fn=_step, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    train_cfg = {"max_steps": max_steps, "log_every": 100, "device": "cpu", "out_dir": str(out),
                 "ckpt_every": 1, "keep_last_k": None, "progress_bar": False}  # fmt: skip
    train_cfg.update(kwargs.pop("train", {}))
    return training_loop(
        model=model, dataset=_batches(start), step_fn=step_fn, hooks=hooks,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train_cfg=train_cfg, **kwargs,
    )  # fmt: skip


def _recorder(events):
    def on_checkpoint(info):
        # The hook runs only after the manifest committed: the checkpoint is resume evidence now.
        manifest = info["path"] + ".ready.json"
        events.append(("on_checkpoint", info["step"], os.path.exists(manifest)))

    def on_train_end(info):
        events.append(("on_train_end", info["step"], info.get("reason")))

    return {"on_checkpoint": [on_checkpoint], "on_train_end": [on_train_end]}


def test_async_publication_matches_sync_files_and_announces_after_commit(tmp_path):
    events: list = []
    _run(tmp_path / "sync")
    _run(tmp_path / "async", hooks=_recorder(events), train={"checkpoint_async": True})
    announced = [e for e in events if e[0] == "on_checkpoint"]
    steps = [e[1] for e in announced]
    # Every periodic checkpoint, then the terminal one after the pending publication drained
    # (the loop may skip the periodic save of the last update, which the terminal one follows).
    assert steps[:5] == [0, 1, 2, 3, 4] and steps[-1] == 6 and steps == sorted(set(steps))
    assert all(e[2] for e in announced)
    for step in (2, 6):
        name = f"step{step:09d}.pt"
        a, b = load(str(tmp_path / "sync" / name)), load(str(tmp_path / "async" / name))
        assert a["step"] == b["step"] and torch.equal(a["model"]["weight"], b["model"]["weight"])


@pytest.mark.parametrize("background", [False, True])
def test_checkpoints_in_parts_inside_the_loop_match_the_one_file_run(tmp_path, background):
    events: list = []
    _run(tmp_path / "one")
    train = {"checkpoint_parts": 2, "checkpoint_async": background}
    _run(tmp_path / "parts", hooks=_recorder(events), train=train)
    assert all(e[2] for e in events if e[0] == "on_checkpoint")  # announced after commit
    for step in (2, 6):
        name = f"step{step:09d}.pt"
        parts = sorted(p.name for p in (tmp_path / "parts").glob(f"{name}.part-*"))
        assert parts == [f"{name}.part-00000-00000", f"{name}.part-00000-00001"]
        a, b = load(str(tmp_path / "one" / name)), load(str(tmp_path / "parts" / name))
        assert (a["step"], a["next_step"]) == (b["step"], b["next_step"])
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in ("weight", "bias"))
    path, ckpt = resolve_auto_resume(tmp_path / "parts")
    assert ckpt["step"] == 6 and path.endswith("step000000006.pt")


class _FailingStore(LocalStore):
    def put(self, key, data, **kwargs):
        if key == "step000000002.pt":
            raise OSError(errno.ENOSPC, "No space left on device", key)
        return super().put(key, data, **kwargs)


def test_failed_background_publication_fails_the_next_step(tmp_path):
    register_store("asyncfail", lambda rest: _FailingStore(tmp_path / rest))
    seen: list = []
    hooks = {"on_exception": [lambda info: seen.append((info["step"], info["exception"]))]}
    with pytest.raises(CheckpointPublishError, match="step000000002.pt failed: OSError"):
        _run(tmp_path, hooks=hooks, train={"checkpoint_async": True,
                                           "checkpoint_dir": "asyncfail://ckpt"})  # fmt: skip
    assert seen and seen[0][0] in (3, 4)  # raised at a following step, never swallowed
    assert resolve_auto_resume(tmp_path / "ckpt")[1]["step"] == 1


def test_full_disk_during_a_synchronous_save_stops_training_and_keeps_the_previous(tmp_path):
    register_store("syncfail", lambda rest: _FailingStore(tmp_path / rest))
    seen: list = []
    hooks = {"on_exception": [lambda info: seen.append(info["step"])]}
    with pytest.raises(OSError, match="No space left on device"):
        _run(tmp_path, hooks=hooks, train={"checkpoint_dir": "syncfail://ckpt"})
    assert seen == [2]  # the update whose save failed; training went no further
    path, ckpt = resolve_auto_resume(tmp_path / "ckpt")
    assert ckpt["step"] == 1 and path.endswith("step000000001.pt")
    assert not (tmp_path / "ckpt" / "step000000002.pt").exists()


def test_evacuation_request_publishes_terminal_checkpoint_and_exits_75(tmp_path):
    controller = EvacuationController()
    events: list = []

    def step_fn(model, batch, ctx):
        if ctx.step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler only records it
        return _step(model, batch, ctx)

    previous = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Evacuated) as info:
        _run(tmp_path, step_fn=step_fn, hooks=_recorder(events), evacuation=controller,
             train={"ckpt_every": 0, "checkpoint_async": True})  # fmt: skip
    assert info.value.code == EVACUATION_EXIT_CODE
    assert info.value.path == str(tmp_path / "step000000003.pt")
    path, ckpt = resolve_auto_resume(tmp_path)
    assert (ckpt["step"], ckpt["next_step"], ckpt["reason"]) == (3, 3, "evacuation")
    assert events == [("on_checkpoint", 3, True), ("on_train_end", 3, "evacuation")]
    assert signal.getsignal(signal.SIGUSR1) is previous  # our handler is gone again


def test_evacuated_run_resumes_to_the_uninterrupted_result(tmp_path):
    straight = _run(tmp_path / "straight")
    controller = EvacuationController()

    def step_fn(model, batch, ctx):
        if ctx.step == 3:
            controller.request()
        return _step(model, batch, ctx)

    with pytest.raises(Evacuated):
        _run(tmp_path / "evac", step_fn=step_fn, evacuation=controller)
    found = resolve_auto_resume(tmp_path / "evac")
    resumed = _run(tmp_path / "evac", start=found[1]["next_step"], resume="auto",
                   checkpoint_dict=found[1], auto_resume_path=found[0])  # fmt: skip
    assert torch.equal(straight["model"]["weight"], resumed["model"]["weight"])


def test_resume_auto_inside_the_loop_and_nothing_left_to_do(tmp_path):
    _run(tmp_path, max_steps=3)
    terminal = tmp_path / "step000000003.pt.ready.json"
    before = terminal.stat().st_ino
    again = _run(tmp_path, max_steps=3, start=3, resume="auto")
    assert again["step"] == 3
    assert terminal.stat().st_ino == before  # not un-committed and re-published
    longer = _run(tmp_path, max_steps=5, start=3, resume="auto")
    assert longer["step"] == 5 and (tmp_path / "step000000005.pt.ready.json").exists()
    assert _run(tmp_path / "none", max_steps=2, resume="none")["step"] == 2
    with pytest.raises(ValueError, match="resume"):
        _run(tmp_path, resume="sometimes")


def test_unhealthy_gpu_checkpoints_and_exits_79(tmp_path):
    good = GpuReading(device="cuda:0", kernel_ok=True)
    bad = GpuReading(device="cuda:0", kernel_ok=False, kernel_error="CUDA error: ECC")
    readings = iter([good, bad])
    watchdog = GpuHealthWatchdog(2, "cpu", out_dir=tmp_path, reader=lambda d: next(readings))
    seen = []
    hooks = {"on_exception": [lambda i: seen.append((i["step"], type(i["exception"])))]}
    with pytest.raises(GpuUnhealthy) as info:
        _run(tmp_path, gpu_health=watchdog, hooks=hooks, train={"ckpt_every": 0})
    assert info.value.code == GPU_HEALTH_EXIT_CODE
    assert [kind for _, kind in seen] == [GpuUnhealthy]  # event hooks report the failure
    _, ckpt = resolve_auto_resume(tmp_path)
    assert (ckpt["step"], ckpt["next_step"], ckpt["reason"]) == (4, 4, "gpu_health")
    assert (tmp_path / "gpu_health.jsonl").read_text().count("\n") == 2


CLI_USER_CODE = """
import os, signal, time
import torch

def make_model(cfg):
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))

def dataset(cfg, start_step=0):
    t = start_step
    while True:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 4, generator=g)
        yield x, x.sum(1, keepdim=True)
        t += 1

def step_fn(model, batch, ctx):
    if ctx.step == int(os.environ.get("ASK_TO_LEAVE_AT", "-1")):
        os.kill(os.getpid(), signal.SIGUSR1)
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}
"""


@pytest.mark.slow
def test_cli_evacuates_with_75_and_resumes_by_default(tmp_path):
    (tmp_path / "evacpkg.py").write_text(CLI_USER_CODE)

    def config(out):
        path = tmp_path / f"{out}.yaml"
        path.write_text(textwrap.dedent(f"""
            train: {{max_steps: 8, log_every: 4, ckpt_every: 3, device: cpu, out_dir: {tmp_path / out},
                     evacuation_enabled: true, progress_bar: false, seed: 7}}
            data: {{batch_size: 8}}
            optim: {{optimizer: {{name: adamw, lr: 0.01}}}}
            logging: {{stdout: false}}
            entry: {{model: evacpkg:make_model, dataset: evacpkg:dataset, step: evacpkg:step_fn}}
        """))  # fmt: skip
        return str(path)

    exe = os.path.join(os.path.dirname(sys.executable), "koochak-train")

    def train(out, **env):
        return subprocess.run([exe, "--config", config(out)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})  # fmt: skip

    first = train("run", ASK_TO_LEAVE_AT="4")
    assert first.returncode == EVACUATION_EXIT_CODE, first.stderr
    assert resolve_auto_resume(tmp_path / "run")[1]["next_step"] == 5
    second = train("run")  # the same command; --resume auto is the default
    assert second.returncode == 0, second.stderr
    assert train("straight").returncode == 0
    a = load(str(tmp_path / "run" / "step000000008.pt"))
    b = load(str(tmp_path / "straight" / "step000000008.pt"))
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


def test_resume_auto_with_the_callers_resolved_checkpoint(tmp_path):
    """The spec's recipe: resolve first, build the dataset from next_step, pass both values."""
    straight = _run(tmp_path / "straight", max_steps=6)
    _run(tmp_path / "run", max_steps=4)  # periodic 0..3 and terminal 4 are published
    path, ckpt = resolve_auto_resume(tmp_path / "run")
    assert ckpt["next_step"] == 4
    # Roll back by hand: the caller's choice wins over what the store holds now.
    older = load(str(tmp_path / "run" / "step000000002.pt"))
    older_path = str(tmp_path / "run" / "step000000002.pt")
    started: list = []
    hooks = {"on_train_start": [lambda info: started.append(info)]}
    resumed = _run(tmp_path / "run", max_steps=6, start=older["next_step"], resume="auto",
                   checkpoint_dict=older, auto_resume_path=older_path, hooks=hooks)  # fmt: skip
    assert started[0]["resumed"] and started[0]["resume_path"] == older_path
    assert started[0]["step"] == 3
    assert torch.equal(straight["model"]["weight"], resumed["model"]["weight"])
    assert torch.equal(straight["model"]["bias"], resumed["model"]["bias"])


def test_gpu_health_keys_are_ignored_on_cpu(tmp_path):
    _run(tmp_path, max_steps=2, train={"gpu_health_every": 1})
    assert not (tmp_path / "gpu_health.jsonl").exists()


def test_terminal_state_is_published_before_on_train_end_and_returned(tmp_path):
    seen: list = []

    def on_train_end(info):
        manifest = tmp_path / f"step{info['step']:09d}.pt.ready.json"
        seen.append((info["step"], manifest.exists()))

    returned = _run(tmp_path, max_steps=3, hooks={"on_train_end": [on_train_end]},
                    train={"checkpoint_async": True})  # fmt: skip
    assert seen == [(3, True)]
    published = load(str(tmp_path / "step000000003.pt"))
    assert (returned["step"], returned["next_step"], returned["reason"]) == (3, 3, "terminal")
    assert published["step"] == 3 and published["reason"] == "terminal"
    for key, tensor in returned["model"].items():
        assert torch.equal(tensor, published["model"][key]), key


def test_a_request_during_setup_is_recorded_and_honoured_after_the_first_update(tmp_path):
    # Without the handler in place SIGUSR1's default action would kill the test process.
    hooks = {"on_train_start": [lambda info: os.kill(os.getpid(), signal.SIGUSR1)]}
    with pytest.raises(Evacuated) as info:
        _run(tmp_path, hooks=hooks, train={"evacuation_enabled": True, "ckpt_every": 0})
    assert info.value.step == 1
    assert resolve_auto_resume(tmp_path)[1]["reason"] == "evacuation"


def test_evacuation_drains_the_pending_async_publication_first(tmp_path):
    controller = EvacuationController()
    events: list = []

    def step_fn(model, batch, ctx):
        if ctx.step == 2:
            controller.request()
        return _step(model, batch, ctx)

    with pytest.raises(Evacuated):
        _run(tmp_path, step_fn=step_fn, hooks=_recorder(events), evacuation=controller,
             train={"ckpt_every": 1, "checkpoint_async": True})  # fmt: skip
    # Periodic 2 was still in flight when the request was honoured: it commits (and is
    # announced) before the evacuation checkpoint 3, which is published synchronously.
    assert events == [("on_checkpoint", 0, True), ("on_checkpoint", 1, True),
                      ("on_checkpoint", 2, True), ("on_checkpoint", 3, True),
                      ("on_train_end", 3, "evacuation")]  # fmt: skip

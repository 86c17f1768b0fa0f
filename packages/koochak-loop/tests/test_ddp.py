"""DDP for real: 2 gloo processes on CPU, launched by torchrun, by torch.multiprocessing, and by
hand with the torchrun environment. This file is also the per-rank training script.

- 2 ranks on the halves of each batch end where 1 process on the whole batch ends;
- an evacuation request seen by rank 1 only makes both ranks publish-then-exit with 75;
- a run moves 1 -> 2 -> 1 ranks through checkpoints and still matches the uninterrupted run;
- a shuffling DataLoader under train.shard_dataset is named, and its iteration keeps the RNG.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import traceback

import pytest
import torch

FULL = 8  # rows per full batch; each of 2 ranks gets half


def _full_batch(t: int) -> dict:
    g = torch.Generator().manual_seed(500 + t)
    x = torch.randn(FULL, 4, generator=g)
    return {"x": x, "y": x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])}


def _half_batches(start: int, stop: int) -> list:
    # Interleaved halves: map-mode sharding hands rank r the items r, r+2, ... i.e. half r of
    # every full batch, so 2 ranks together see exactly the single-process batches.
    out = []
    for t in range(start, stop):
        full = _full_batch(t)
        out += [{k: v[: FULL // 2] for k, v in full.items()}, {k: v[FULL // 2 :] for k, v in full.items()}]
    return out


def _step_fn(model, batch, ctx):
    if ctx.world_size > 1 and ctx.rank == 1 and os.environ.get("EVACUATE_AT") == str(ctx.step):
        os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is asked to leave
    x = batch["x"]
    if os.environ.get("NOISE"):  # per-rank randomness, so resume must restore each rank's RNG
        x = x * (1 + 0.1 * torch.rand_like(x))
    return {"loss": torch.nn.functional.mse_loss(model(x), batch["y"])}


def _train(out_dir: str, max_steps: int, ddp: bool) -> dict:
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # each rank its own stream
    location = out_dir
    if os.environ.get("FULL_DISK_AT"):  # checkpoints go to a store whose disk fills up then
        from koochak.storage.store import LocalStore, register_store

        doomed = f"step{int(os.environ['FULL_DISK_AT']):09d}.pt"

        class FullDisk(LocalStore):
            def put(self, key, data, **expected):
                if key == doomed:
                    raise OSError(28, "No space left on device", key)
                return super().put(key, data, **expected)

        register_store("fulldisk", lambda rest: FullDisk(out_dir))
        location = "fulldisk://"
    found = resolve_auto_resume(location)
    ckpt, path = (found[1], found[0]) if found else (None, None)
    start = ckpt["next_step"] if ckpt else 0
    dataset = _half_batches(start, max_steps) if ddp else [_full_batch(t) for t in range(start, max_steps)]
    return training_loop(
        model=model,
        dataset=dataset,
        step_fn=_step_fn,
        optimizer=optimizer,
        train_cfg={
            "max_steps": max_steps,
            "log_every": 1000,
            "device": "cpu",
            "out_dir": out_dir,
            "checkpoint_dir": location,
            "ddp": ddp,
            "shard_dataset": True,
            "shard_dataset_mode": "map",
            "evacuation_enabled": True,
            "progress_bar": False,
        },
        resume="auto",
        checkpoint_dict=ckpt,
        auto_resume_path=path,
    )


def _spawned(local_rank: int, out_dir: str, max_steps: int, port: int) -> None:
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    _leave(lambda: _train(out_dir, max_steps, ddp=True))


def _leave(train) -> None:
    """Run ``train`` as one rank and end the process with its code (75 when evacuated) the way
    koochak-train does, without interpreter finalisation (which can abort a gloo DDP rank)."""
    from koochak.loop.dist import exit_distributed_process

    try:
        train()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        code = 1
    exit_distributed_process(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(*args: str) -> list[str]:
    return [__file__, *args]


def _weights(ckpt: dict) -> torch.Tensor:
    return torch.cat([v.flatten() for v in ckpt["model"].values()])


@pytest.mark.slow
def test_two_ranks_match_one_process_on_the_concatenated_batch(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={_free_port()}",
           *_script("train", str(tmp_path / "ddp"), "4")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    from koochak.loop.checkpoint import load

    ddp_final = load(str(tmp_path / "ddp" / "step000000004.pt"))
    assert ddp_final["world_size"] == 2 and len(ddp_final["rng_per_rank"]) == 2
    single_final = _train(str(tmp_path / "single"), 4, ddp=False)
    assert torch.allclose(_weights(ddp_final), _weights(single_final), atol=1e-6)
    assert "module." not in next(iter(ddp_final["model"]))


def _data_rank(out_dir: str, kind: str) -> None:
    """One rank fed a DataLoader (``loader``: a RandomSampler with its own generator, so only
    ``iter`` itself draws from the global RNG) or the same batches as a list (``list``),
    sharded by train.shard_dataset; prints its first draw."""
    from koochak.loop import training_loop
    from torch.utils.data import DataLoader, RandomSampler

    def batches():
        data = [torch.tensor([float(i)]) for i in range(16)]
        order = RandomSampler(data, generator=torch.Generator().manual_seed(7))
        return DataLoader(data, batch_size=2, sampler=order)

    def step_fn(model, batch, ctx):
        if ctx.step == 0:
            print(f"first draw on rank {ctx.rank}: {torch.rand(1).item()!r}", flush=True)
        return {"loss": model(batch).pow(2).mean()}

    model = torch.nn.Linear(1, 1)
    dataset = batches() if kind == "loader" else list(batches())
    torch.manual_seed(3)
    training_loop(model=model, dataset=dataset, step_fn=step_fn, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                  train_cfg={"max_steps": 2, "device": "cpu", "out_dir": out_dir, "ddp": True,
                             "shard_dataset": True, "progress_bar": False, "log_every": 100})  # fmt: skip


def test_under_ddp_a_shuffling_dataloader_is_named_and_leaves_the_rng_alone(tmp_path):
    """train.shard_dataset wraps the DataLoader in a sharded iterable: the loop still prints its
    one line (rank 0) and iterating it still leaves each rank's global RNG as the same batches
    handed as a list do (a resumed run would otherwise draw other dropout masks)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    outputs = {}
    for kind in ("loader", "list"):
        cmd = [torchrun, "--nproc_per_node=2", f"--master_port={_free_port()}",
               *_script("data", str(tmp_path / kind), kind)]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs[kind] = result.stdout
    note = "koochak: the dataset is a DataLoader with a random sampler"
    assert outputs["loader"].count(note) == 1
    # The ranks share torchrun's stdout: their lines may run into each other.
    draws = {kind: sorted(re.findall(r"first draw on rank (\d+): ([-0-9.e]+)", out))
             for kind, out in outputs.items()}  # fmt: skip
    assert len(draws["loader"]) == 2 and draws["loader"] == draws["list"]


def _two_ranks(out_dir, steps: int, **env: str) -> tuple[list[int], list[str]]:
    """Launch both ranks by hand with the torchrun environment; (exit codes, outputs)."""
    port = _free_port()
    procs = []
    for rank in (0, 1):
        rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, *_script("train", str(out_dir), str(steps))],
                                      env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    return [p.returncode for p in procs], outputs


@pytest.mark.slow
def test_evacuation_requested_on_rank_1_exits_both_ranks_with_75_and_resumes_exactly(tmp_path):
    from koochak.loop.checkpoint import load, resolve_auto_resume

    codes, outputs = _two_ranks(tmp_path / "run", 6, EVACUATE_AT="2", NOISE="1")
    assert codes == [75, 75], outputs
    path, ckpt = resolve_auto_resume(tmp_path / "run")
    assert path.endswith("step000000003.pt")
    assert (ckpt["step"], ckpt["next_step"], ckpt["reason"]) == (3, 3, "evacuation")
    assert len(ckpt["rng_per_rank"]) == 2
    # The same command again continues at update 3 with each rank's own RNG stream, and ends
    # bit-identical to a 2-rank run that was never interrupted.
    assert _two_ranks(tmp_path / "run", 6, NOISE="1")[0] == [0, 0]
    assert _two_ranks(tmp_path / "straight", 6, NOISE="1")[0] == [0, 0]
    resumed = load(str(tmp_path / "run" / "step000000006.pt"))
    straight = load(str(tmp_path / "straight" / "step000000006.pt"))
    assert torch.equal(_weights(resumed), _weights(straight))


@pytest.mark.slow
def test_a_failed_terminal_save_on_rank_0_stops_both_ranks_with_its_error(tmp_path):
    codes, outputs = _two_ranks(tmp_path, 4, FULL_DISK_AT="4")
    assert codes == [1, 1], outputs
    assert "No space left on device" in outputs[0]
    # Rank 1 learns why from rank 0 instead of waiting in a collective that never completes.
    assert "rank 0 could not save the terminal checkpoint at step 4: OSError" in outputs[1]


@pytest.mark.slow
def test_resume_across_world_sizes_one_two_one(tmp_path):
    run = str(tmp_path / "run")
    _train(run, 2, ddp=False)
    result = subprocess.run([sys.executable, *_script("spawn", run, "4", str(_free_port()))],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    from koochak.loop.checkpoint import load

    # Each leg really ran at its world size and continued from the previous leg's checkpoint.
    middle = load(os.path.join(run, "step000000004.pt"))
    assert (middle["world_size"], len(middle["rng_per_rank"])) == (2, 2)
    assert load(os.path.join(run, "step000000002.pt"))["world_size"] == 1
    final = _train(run, 6, ddp=False)
    uninterrupted = _train(str(tmp_path / "straight"), 6, ddp=False)
    assert (final["step"], final["world_size"]) == (6, 1)
    assert torch.allclose(_weights(final), _weights(uninterrupted), atol=1e-6)


def _setup(rank: int, world_size: int = 2):
    from koochak.loop.ddp import DdpSetup

    return DdpSetup(True, rank, world_size, rank, False, torch.device("cpu"))


def test_sharding_is_opt_in_for_train_and_eval_and_rank0_warns_about_the_rest(recwarn):
    from koochak.loop.ddp import shard_datasets

    cfg = {"shard_dataset": True, "shard_dataset_mode": "map",
           "shard_eval_dataset": True, "shard_eval_dataset_mode": "iterable"}  # fmt: skip
    train, evaluation = shard_datasets(list(range(10)), list(range(6)), cfg, _setup(1))
    assert list(train) == [1, 3, 5, 7, 9] and list(evaluation) == [1, 3, 5]
    assert not recwarn.list
    # An unsharded eval set is correct (docs/fsdp.md recommends it under FSDP): no warning.
    train, evaluation = shard_datasets([0, 1], [0, 1], {"shard_dataset": True}, _setup(0))
    assert list(evaluation) == [0, 1]  # unsharded: every rank sees all of it
    assert not recwarn.list
    with pytest.warns(RuntimeWarning, match=r"train.shard_dataset is false: every rank sees"):
        shard_datasets([0, 1], [0, 1], {}, _setup(0))
    shard_datasets([0, 1], None, {}, _setup(1))  # only rank 0 warns
    shard_datasets([0, 1], None, {"warn_unsharded": False}, _setup(0))
    assert not recwarn.list
    assert shard_datasets([0, 1], None, {}, _setup(0, world_size=1))[0] == [0, 1]


def test_wrap_model_passes_find_unused_parameters_through(tmp_path):
    from koochak.loop.ddp import wrap_model

    model = torch.nn.Linear(2, 1)
    assert wrap_model(model, _setup(0, world_size=1), {}) is model  # nothing to all-reduce
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        for flag in (True, False):
            wrapped = wrap_model(model, _setup(0), {"find_unused_parameters": flag})
            assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            assert wrapped.find_unused_parameters is flag
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    if mode == "data":  # one rank of the DataLoader check, environment from torchrun
        _leave(lambda: _data_rank(out_dir, sys.argv[3]))
    steps = int(sys.argv[3])
    if mode == "train":  # one rank, environment from torchrun or the test
        _leave(lambda: _train(out_dir, steps, ddp=True))
    else:  # "spawn": both ranks via torch.multiprocessing
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(out_dir, steps, int(sys.argv[4])), nprocs=2, join=True)

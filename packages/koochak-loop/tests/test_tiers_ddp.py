"""Tiers under DDP: 2 gloo ranks on CPU, each with its own node-local first tier.

Only rank 0 saves, so rank 1's first tier stays empty, as on a second node. At resume rank 0
chooses the checkpoint (from its first tier) and rank 1 reads that very commit from the only tier
it can reach, the shared durable one. This file is also the per-rank training script.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch


def _batches(start: int, stop: int, rank: int) -> list:
    out = []
    for t in range(start, stop):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(700 + t))
        out.append((x[rank * 4 : rank * 4 + 4], x[rank * 4 : rank * 4 + 4].sum(1, keepdim=True)))
    return out


def _step(model, batch, ctx):
    x, y = batch
    return {"loss": torch.nn.functional.mse_loss(model(x), y)}


def _train(out_dir: str, max_steps: int) -> None:
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume

    rank = int(os.environ["RANK"])
    tiers = [os.path.join(out_dir, f"node{rank}"), os.path.join(out_dir, "durable")]
    found = resolve_auto_resume(tiers)  # only for where the data starts; the loop chooses
    start = found.checkpoint["next_step"] if found else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def said(info):  # where the loop itself resumed this rank from
        if info["resumed"]:
            print(f"RESUMED rank {rank} from {info['resume_path']}", flush=True)

    training_loop(
        model=model, dataset=_batches(start, max_steps, rank), step_fn=_step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_cfg={"max_steps": max_steps, "log_every": 1000, "device": "cpu", "ddp": True,
                   "out_dir": tiers[0], "checkpoint_replicas": tiers[1:], "ckpt_every": 1,
                   "keep_last_k": None, "progress_bar": False, "warn_unsharded": False},
        resume="auto", hooks={"on_train_start": [said]},
    )  # fmt: skip


def _two_ranks(out_dir, steps: int) -> tuple[list[int], list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, str(out_dir), str(steps)],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))  # fmt: skip
    outputs = [p.communicate(timeout=300)[0].decode() for p in procs]
    return [p.returncode for p in procs], outputs


@pytest.mark.slow
def test_ranks_on_different_nodes_resume_the_same_commit_from_the_tiers_they_reach(tmp_path):
    from koochak.loop.checkpoint import load

    codes, outputs = _two_ranks(tmp_path / "run", 3)
    assert codes == [0, 0], outputs
    assert not (tmp_path / "run" / "node1").exists()  # rank 1 never saves
    codes, outputs = _two_ranks(tmp_path / "run", 5)
    assert codes == [0, 0], outputs
    assert f"RESUMED rank 0 from {tmp_path / 'run' / 'node0' / 'step000000003.pt'}" in outputs[0]
    assert f"RESUMED rank 1 from {tmp_path / 'run' / 'durable' / 'step000000003.pt'}" in outputs[1]
    codes, outputs = _two_ranks(tmp_path / "straight", 5)
    assert codes == [0, 0], outputs
    name = "step000000005.pt"
    resumed = load(str(tmp_path / "run" / "durable" / name))["model"]
    straight = load(str(tmp_path / "straight" / "durable" / name))["model"]
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


if __name__ == "__main__":
    from koochak.loop.dist import exit_distributed_process

    try:
        _train(sys.argv[1], int(sys.argv[2]))
        code = 0
    except Exception:
        traceback.print_exc()
        code = 1
    exit_distributed_process(code)

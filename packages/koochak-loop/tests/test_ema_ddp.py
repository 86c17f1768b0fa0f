"""EMA under DDP for real: 2 gloo ranks launched by torchrun, each keeping its own shadows.

DDP makes every rank's parameters identical after each update, so their shadows (updated without
any communication) are identical too; floating buffers (BatchNorm statistics) are rank-local
between DDP's broadcasts, and so are their shadows: rank 0's are the ones saved, as its buffers
are. Rank 0's checkpoint holds its shadows, keyed without ``module.``, and a single process
continues from it.
This file is also the per-rank training script.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch


def _train(out_dir: str) -> None:
    from koochak.loop import training_loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    batches = [
        (x, x.sum(dim=1, keepdim=True)) for x in (torch.randn(8, 4, generator=g) for _ in range(12))
    ]

    def step_fn(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    final = training_loop(
        model=model, dataset=batches, step_fn=step_fn,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
        train_cfg={"max_steps": 12, "log_every": 1000, "device": "cpu", "out_dir": out_dir,
                   "ddp": True, "warn_unsharded": False,
                   "ema": {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}}},
    )  # fmt: skip
    torch.save(final["ema"], os.path.join(out_dir, f"ema_rank{rank}.pt"))
    from koochak.loop.dist import exit_distributed_process

    exit_distributed_process(0)  # a gloo DDP rank can abort in interpreter finalisation


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_every_rank_keeps_identical_shadows_and_rank_0_saves_them(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node=2", f"--master_port={_free_port()}", __file__, str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    from koochak.loop.checkpoint import load

    ranks = [torch.load(tmp_path / f"ema_rank{r}.pt", weights_only=True) for r in (0, 1)]
    saved = load(str(tmp_path / "step000000012.pt"))["ema"]
    for shadows in zip(ranks[0]["shadows"], ranks[1]["shadows"], saved["shadows"], strict=True):
        keys = list(shadows[0]["state_dict"])
        assert keys and not any(k.startswith("module.") for k in keys)
        for key in keys:
            values = [s["state_dict"][key] for s in shadows]
            assert torch.equal(values[0], values[2]), key  # rank 0's shadows are saved
            if "running" not in key:  # parameters: the same on every rank
                assert torch.equal(values[0], values[1]), key
    assert ranks[0]["updates"] == ranks[1]["updates"] == 12

    # The 2-rank checkpoint, shadows included, continues in one process.
    from koochak.loop import training_loop

    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)
    )
    x = torch.randn(8, 4)
    final = training_loop(
        model=model, dataset=[(x, x.sum(dim=1, keepdim=True))] * 2, optimizer=torch.optim.AdamW(model.parameters()),
        step_fn=lambda m, b, ctx: {"loss": torch.nn.functional.mse_loss(m(b[0]), b[1])},
        checkpoint_dict=load(str(tmp_path / "step000000012.pt")),
        train_cfg={"max_steps": 14, "log_every": 1000, "device": "cpu", "out_dir": str(tmp_path / "one"),
                   "ema": {"dual": {"enabled": True, "srel1": 0.05, "srel2": 0.10}}},
    )  # fmt: skip
    assert (final["ema"]["step"], final["ema"]["updates"], final["world_size"]) == (14, 14, 1)


if __name__ == "__main__":
    _train(sys.argv[1])

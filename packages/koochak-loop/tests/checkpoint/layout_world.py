"""The layout conformance suite's runs: one tiny model trained a few steps with periodic saves.

Imported by test_layout_conformance.py for the one-process layouts (one file, parts=2), and run
as a script for the sharded one, once per rank of a gloo world (torchrun's environment set by
the test): ``python layout_world.py OUT SPEC.json`` runs every scenario in SPEC (a list of
``{name, first, replicas, async}``) in a row, each rank writing ``<name>.<rank>.json`` (its
outcome) and rank 0 ``<name>.final.pt`` (the terminal checkpoint's state, gathered), so one
world start serves every sharded case. ``python layout_world.py --kill ROOT LAYOUT`` publishes
step 1, then blocks inside step 2's save for the test to kill -9; ``--kill-sharded ROOT`` (every
rank) does the same to a sharded run's step 2.

The first tier of an async run is ``slowdir://`` (a LocalStore whose puts wait 50 ms each), so
the background writer is still writing while the next updates change the parameters in place:
the dirty-data proof.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

WIDTH, STEPS, KEEP_FIRST, KEEP_REPLICA = 12, 4, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyNet()


def batches(start: int = 0):
    for t in range(start, 1000):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(4, WIDTH, generator=g)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": nn.functional.mse_loss(model(x), y)}


class SlowStore:
    """Factory of ``slowdir://PATH``: a LocalStore at /PATH whose every put waits first."""

    def __new__(cls, path: str):
        from koochak.storage.store import LocalStore

        class _Slow(LocalStore):
            def put(self, key, data, **kwargs):
                time.sleep(0.05)
                return super().put(key, data, **kwargs)

        return _Slow("/" + path.lstrip("/"))


def register_slow() -> None:
    from koochak.storage.store import register_store

    register_store("slowdir", SlowStore)


def train_cfg(first: str, replicas: list, layout: str, async_save: bool, **more) -> dict:
    cfg = {
        "max_steps": STEPS, "log_every": 100, "device": "cpu", "progress_bar": False,
        "out_dir": first, "checkpoint_dir": ("slowdir://" + first) if async_save else first,
        "ckpt_every": 1, "keep_last_k": KEEP_FIRST, "checkpoint_async": async_save,
        "checkpoint_parts": 2 if layout == "parts" else 1,
        "checkpoint_replicas": [{"location": r, "keep_last_k": KEEP_REPLICA} for r in replicas],
        "checkpoint_replication_retry_s": 0,
    }  # fmt: skip
    if layout == "sharded":
        cfg["fsdp"] = {"enabled": True, "shard_modules": ["Block"]}
    cfg.update(more)
    return cfg


def run(first: str, replicas: list, layout: str, async_save: bool, **more) -> dict:
    """Train STEPS updates saving after each; the terminal checkpoint training_loop returns."""
    from koochak.loop import training_loop

    register_slow()
    model = make_model()
    return training_loop(
        model=model, dataset=batches(), step_fn=step_fn,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=0.05),
        train_cfg=train_cfg(first, replicas, layout, async_save, **more),
    )  # fmt: skip


def _world(out: str, spec_path: str) -> int:
    from koochak.loop import fsdp

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    with open(spec_path) as f:
        specs = json.load(f)
    for spec in specs:
        try:
            result = run(spec["first"], spec["replicas"], "sharded", spec["async"])
            outcome = {"ok": True}
        except Exception as exc:
            result, outcome = None, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if result is not None:
            result = fsdp.full(result)
            if rank == 0:
                torch.save({"model": result["model"], "optimizer": result["optimizer"],
                            "step": result["step"]},
                           os.path.join(out, f"{spec['name']}.final.pt"))  # fmt: skip
        with open(os.path.join(out, f"{spec['name']}.{rank}.json"), "w") as f:
            json.dump(outcome, f)
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


def _kill(root: str, layout: str) -> int:
    from koochak.loop.checkpoint import build_checkpoint, publish
    from koochak.storage.store import LocalStore

    parts = 2 if layout == "parts" else 1
    model = make_model()
    publish(root, "step000000001.pt", build_checkpoint(step=1, next_step=2, model=model),
            parts=parts)  # fmt: skip

    class Stuck(LocalStore):
        def put(self, key, data, **kwargs):
            if ".part-" in key or key == "step000000002.pt":
                # Half of this object is written, then the process is killed.
                with open(os.path.join(root, key), "wb") as f:
                    f.write(b"half an object")
                with open(os.path.join(root, "READY_TO_KILL"), "w"):
                    pass
                time.sleep(600)
            return super().put(key, data, **kwargs)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    publish(Stuck(root), "step000000002.pt", build_checkpoint(step=2, next_step=3, model=model),
            parts=parts)  # fmt: skip
    return 1  # never reached: killed


def _kill_sharded(root: str) -> int:
    """Every rank trains with saves after each update; inside step 2's save every rank's part
    put stops half-way (its marker written) until the test kills the world with SIGKILL."""
    from koochak.storage.store import LocalStore, register_store

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()

    class Stuck(LocalStore):
        def put(self, key, data, **kwargs):
            if key.startswith("step000000002.pt.part-"):
                with open(os.path.join(self.root, key), "wb") as f:
                    f.write(b"half a part")
                with open(os.path.join(self.root, f"READY_TO_KILL.{rank}"), "w"):
                    pass
                time.sleep(600)
            return super().put(key, data, **kwargs)

    register_store("stuckdir", lambda path: Stuck("/" + path.lstrip("/")))
    run(root, [], "sharded", False, checkpoint_dir="stuckdir://" + root)
    return 1  # never reached: killed


if __name__ == "__main__":
    if sys.argv[1] == "--kill":
        sys.exit(_kill(sys.argv[2], sys.argv[3]))
    if sys.argv[1] == "--kill-sharded":
        sys.exit(_kill_sharded(sys.argv[2]))
    sys.exit(_world(sys.argv[1], sys.argv[2]))

"""Recipe: your own training loop, with Koochak's checkpoints as a toolbox (Fabric-style).

The loop below is plain PyTorch; Koochak contributes the pieces a loop must not get wrong: the
resume lookup (the highest valid published checkpoint over every tier), the restore (RNG last),
the elastic data cursor, periodic and terminal checkpoints (published create-only, replicated to
a second tier), the user's extra state, and evacuation (SIGUSR1: checkpoint, then exit 75).

    python -m examples.recipes.own_loop runs/recipes/own_loop [max_steps]
"""

from __future__ import annotations

import sys
import time

import torch
from koochak.loop.checkpoint.restore import restore_rng, restore_training_state
from koochak.loop.checkpoint.resume import resume_checkpoint
from koochak.loop.checkpoint.saver import make_checkpointer
from koochak.loop.checkpoint.tier_marker import run_identity
from koochak.loop.checkpoint.tiers import checkpoint_locations
from koochak.loop.config import resolve_train_config
from koochak.loop.elastic import ElasticBatches, elastic_cursor
from koochak.loop.evacuation import make_evacuation

from examples.recipes.data import make_mlp


def main(out_dir: str, max_steps: int = 40) -> None:
    cfg = resolve_train_config({"out_dir": out_dir, "max_steps": max_steps, "ckpt_every": 5,
                                "checkpoint_replicas": [{"location": f"{out_dir}-replica",
                                                         "create": True}]})  # fmt: skip
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    records = [(x, x.sin().sum().reshape(1)) for x in torch.randn(512, 8)]
    data = ElasticBatches(records, global_batch=32, seed=0)
    run_id = run_identity(cfg, 0)  # claims (marks) every tier for this run
    _, ckpt = resume_checkpoint("auto", checkpoint_locations(cfg)) or (None, None)
    step = ckpt["next_step"] if ckpt else 0
    cursor = elastic_cursor(data, ckpt, step, grad_accum=1)  # before the data is iterated
    if ckpt:
        restore_training_state(ckpt, model, opt, state={"sched": sched})
    # What every checkpoint captures; "state" takes any object with state_dict/load_state_dict.
    parts = {"model": model, "optimizer": opt, "scheduler": None, "scaler": None,
             "config": {"train": {"max_steps": max_steps}}, "data": cursor, "run_id": run_id,
             "state": {"sched": sched}}  # fmt: skip
    saves = make_checkpointer(
        cfg, parts, rank=0, resumed=ckpt, started=time.perf_counter(), on_checkpoint=None
    )
    evacuation = make_evacuation(True, cfg)
    evacuation.install()
    if ckpt:
        restore_rng(ckpt)  # last, right before the first step
    for x, y in data:
        if step == max_steps:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if saves.due(step):
            saves.periodic(step, {"loss": loss.item()})
        step += 1
        if evacuation.should_evacuate():
            saves.terminal("evacuation", step, {})
            sys.exit(75)
    saves.terminal("terminal", step, {})
    evacuation.uninstall()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))

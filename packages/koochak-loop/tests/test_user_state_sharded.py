"""The user's ``state`` under FSDP: a resume reads only this rank's rows of it (issue 38 leftover).

One gloo rank in-process: the selection's lazy checkpoint is materialized with and without the
run's live ``state``; with it, an extra optimizer over the sharded parameters gets its per-
parameter state as this rank's slab (a DTensor placed like the parameter), not as a whole
tensor that every rank reads and then cuts."""

from __future__ import annotations

import torch
from koochak.loop.checkpoint.layouts.sharded import save_sharded
from koochak.loop.checkpoint.restore import restore_training_state
from koochak.loop.checkpoint.saver import capture_checkpoint
from koochak.loop.checkpoint.selection import resolve_sharded
from koochak.loop.checkpoint.sharded_read import materialize
from koochak.loop.dist import is_dtensor
from koochak.storage.store import LocalStore


def _run(tmp_path):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    fully_shard(model)
    main = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = torch.optim.Adam(model.parameters(), lr=0.01)  # user state: e.g. a GAN's second
    for opt in (main, extra):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, main, extra


def test_an_extra_optimizer_in_state_is_read_as_this_ranks_slab(tmp_path):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        model, main, extra = _run(tmp_path)
        store = LocalStore(str(tmp_path / "ckpt"))
        ckpt = capture_checkpoint(step=0, next_step=1, reason="periodic", model=model,
                                  optimizer=main, scheduler=None, scaler=None, config=None,
                                  wall_time=0.0, metrics=None, state={"extra": extra},
                                  sharded=True)  # fmt: skip
        save_sharded(store, "step000000000.pt", ckpt)
        saved = {k: v.full_tensor().clone() for k, v in extra.state_dict()["state"][0].items()
                 if is_dtensor(v)}  # fmt: skip

        def entry(state):
            _, lazy = resolve_sharded(store)
            return materialize(lazy, model, main, None, state)["user_state"]["entries"]["extra"]

        assert not any(is_dtensor(v) for v in entry(None)["state"][0].values())  # whole
        read = entry({"extra": extra})["state"][0]
        assert is_dtensor(read["exp_avg"]) and is_dtensor(read["exp_avg_sq"])  # this rank's slab

        fresh = torch.optim.Adam(model.parameters(), lr=0.01)
        _, lazy = resolve_sharded(store)
        restore_training_state(lazy, model, main, state={"extra": fresh})
        for key, value in saved.items():
            assert torch.equal(fresh.state_dict()["state"][0][key].full_tensor(), value)
    finally:
        torch.distributed.destroy_process_group()

"""The checkpoint component's shape (issue 36, "one checkpoint component, opened once"): the loop
reaches checkpoints through one module, and a plain periodic save walks few of the package's
files. Counted, never timed."""

from __future__ import annotations

import ast
import re
import sys
import time
from pathlib import Path

import torch
from koochak.loop.checkpoint.run_checkpoints import open_checkpoints
from koochak.loop.config import resolve_train_config

LOOP_PY = Path(__file__).parents[1] / "src" / "koochak" / "loop" / "loop.py"
KOOCHAK_SOURCE = re.compile(r"[/\\]packages[/\\][^/\\]+[/\\]src[/\\]koochak[/\\]")

# koochak source files one periodic save enters (one file, one local directory, the run's real
# lease): 26 on main before issue 36's seam was finished (the loop's save block: the lease check,
# then Checkpointer.periodic), 28 through this component at first; 20 now. What went: publish's
# per-save clear of the name (parts_io, parts_index), the numpy-tag tree walk's hop into the read
# side (layout_read), the one-process RNG gather (ddp, dist: the saver knows the world size and
# the layout once), the lease check's hop through run_lease (the component reads its leases),
# publication's removal hop (commit), user_state without user state, open_store for a Store.
MOST_FILES = 20


def _component(tmp_path):
    cfg = resolve_train_config(
        {"max_steps": 100, "ckpt_every": 2, "device": "cpu", "out_dir": str(tmp_path)}
    )
    checkpoints = open_checkpoints(cfg, rank=0, world_size=1, resume="none")
    model = torch.nn.Linear(4, 4)
    parts = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
             "scheduler": None, "scaler": None, "ema": None, "config": {"train": {}},
             "data": None, "run_id": checkpoints.run_id, "state": None,
             "origin": None}  # fmt: skip
    checkpoints.restore(parts, started=time.perf_counter())
    return checkpoints


def _files_entered(call) -> set[str]:
    entered: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and KOOCHAK_SOURCE.search(frame.f_code.co_filename):
            entered.add(frame.f_code.co_filename.replace("\\", "/").split("/src/koochak/")[1])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return entered


def test_a_plain_periodic_save_enters_few_files_and_no_sharded_or_replication_module(tmp_path):
    checkpoints = _component(tmp_path)
    try:
        assert checkpoints.due(1) and not checkpoints.due(2)
        checkpoints.periodic(1, {"loss": 1.0})  # warm-up: imports and first-call work
        entered = _files_entered(lambda: checkpoints.periodic(3, {"loss": 1.0}))
    finally:
        checkpoints.release()
    assert (tmp_path / "step000000003.pt").exists()
    # A one-file save in one local directory has nothing to do with shards, tiers or replicas.
    others = {"sharded", "sharded_read", "replication", "tiers", "tier_marker", "part_receipt",
              "index_fragments", "host_buffers", "verified_read", "resume"}  # fmt: skip
    assert not {f for f in entered if Path(f).stem in others}, sorted(entered)
    assert "loop/checkpoint/run_checkpoints.py" in entered  # it is the component's own save
    assert len(entered) <= MOST_FILES, sorted(entered)


def test_loop_py_imports_one_checkpoint_module():
    tree = ast.parse(LOOP_PY.read_text())
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names}  # fmt: skip
    assert {m for m in imported if m.startswith("koochak.loop.checkpoint")} == {
        "koochak.loop.checkpoint.run_checkpoints"
    }
    assert "koochak.loop.run_lease" not in imported  # the claim is the component's


def test_the_rng_comes_back_last_after_whatever_the_setup_draws(tmp_path):
    # The component restores the training state when the loop hands it the live objects and the
    # RNG only right before the first step: an optimizer factory or an on_train_start hook that
    # draws random numbers on resume must not move the resumed run off the uninterrupted one.
    from koochak.loop import training_loop

    def run(steps, where, checkpoint=None, draws=False):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(8, 1))  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        data = [(torch.randn(2, 4, generator=gen), torch.randn(2, 1, generator=gen))
                for _ in range(6)][checkpoint["next_step"] if checkpoint else 0:]  # fmt: skip

        def optimizer(m):
            if draws:
                torch.rand(7)
            return torch.optim.SGD(m.parameters(), lr=0.1)

        hooks = {"on_train_start": [lambda info: torch.rand(11)]} if draws else None
        training_loop(
            model=model, dataset=data, optimizer=optimizer, hooks=hooks, checkpoint_dict=checkpoint,
            step_fn=lambda m, b, ctx: {"loss": torch.nn.functional.mse_loss(m(b[0]), b[1])},
            train_cfg={"max_steps": steps, "device": "cpu", "out_dir": str(tmp_path / where)},
        )  # fmt: skip
        return model

    reference = run(6, "ref")
    torch.manual_seed(99)
    first = run(3, "a")
    from koochak.loop.checkpoint import load

    saved = load(tmp_path / "a" / "step000000003.pt")
    resumed = run(6, "b", saved, draws=True)
    assert first is not resumed
    for a, b in zip(reference.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

"""kill -9 during replication: no half-visible replica, and the next run completes the copy.

This file is also the training script the test launches (``python test_tiers_kill.py OUT MODE``):
a tiny CPU model saving after every update into a first tier ``OUT/fast`` replicated to
``killtier://durable``, a store that SIGKILLs the process while it copies step 2 into the
durable tier: half-way through the object (``object``) or as the manifest that would commit it
is written (``manifest``), or, with checkpoints in two parts, half-way through its second part
(``part``). ``none`` runs without a kill and resumes automatically.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

MAX_STEPS = 8
KILL_STEP = 2


def _killing_store(root: str, mode: str):
    from koochak.storage.store import LocalStore

    name = f"step{KILL_STEP:09d}.pt"

    class KillingStore(LocalStore):
        def put(self, key, data, **expected):
            if (mode == "object" and key == name) or (
                mode == "part" and key == f"{name}.part-00000-00001"
            ):
                chunks = [bytes(c) for c in ([data] if isinstance(data, bytes) else data)]
                whole = b"".join(chunks)

                def half_then_die():
                    yield whole[: len(whole) // 2]
                    os.kill(os.getpid(), signal.SIGKILL)
                    yield whole[len(whole) // 2 :]

                return super().put(key, half_then_die(), **expected)
            if mode == "manifest" and key == name + ".ready.json":
                os.kill(os.getpid(), signal.SIGKILL)
            return super().put(key, data, **expected)

    return KillingStore(root)


def main(out_dir: str, mode: str, parts: int) -> None:
    from koochak.loop import training_loop
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.storage.store import register_store

    register_store("killtier", lambda rest: _killing_store(os.path.join(out_dir, rest), mode))
    tiers = [os.path.join(out_dir, "fast"), "killtier://durable"]
    found = resolve_auto_resume(tiers)
    start = found.checkpoint["next_step"] if found else 0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)

    def batches():
        for t in range(start, 1000):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(t))
            yield x, x.sum(1, keepdim=True)

    def step(model, batch, ctx):
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(model(x), y)}

    training_loop(
        model=model, dataset=batches(), step_fn=step,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        train_cfg={"max_steps": MAX_STEPS, "log_every": 100, "device": "cpu",
                   "out_dir": tiers[0], "ckpt_every": 1, "keep_last_k": None,
                   "progress_bar": False, "checkpoint_replicas": [tiers[1]],
                   "checkpoint_replication_retry_s": 0, "checkpoint_parts": parts},
        resume="auto",
        checkpoint_dict=found.checkpoint if found else None,
        auto_resume_path=found.path if found else None,
    )  # fmt: skip


def _launch(out_dir, mode, parts):
    return subprocess.run(
        [sys.executable, __file__, str(out_dir), mode, str(parts)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "parts"), [("object", 1), ("manifest", 1), ("part", 2)])
def test_kill_during_replication_leaves_no_replica_and_the_next_run_completes_it(
    tmp_path, mode, parts
):
    from koochak.loop.checkpoint import checkpoint_objects, resolve_auto_resume
    from koochak.storage.artifact import read_manifest
    from koochak.storage.store import LocalStore

    name = f"step{KILL_STEP:09d}.pt"
    killed = _launch(tmp_path, mode, parts)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    durable = tmp_path / "durable"
    # Nothing half-copied is committed: step 2 has no manifest in the durable tier...
    assert not (durable / f"{name}.ready.json").exists()
    # ...and is no resume evidence there, while the first tier's copy of it is.
    durable_point = resolve_auto_resume(durable)
    assert durable_point is None or durable_point.checkpoint["step"] < KILL_STEP
    fast_point = resolve_auto_resume(tmp_path / "fast")
    assert fast_point.checkpoint["step"] >= KILL_STEP

    finished = _launch(tmp_path, "none", parts)
    assert finished.returncode == 0, finished.stderr[-2000:]
    fast, replica = LocalStore(tmp_path / "fast"), LocalStore(durable)
    committed = sorted(p.name[: -len(".ready.json")] for p in durable.glob("*.ready.json"))
    assert name in committed and f"step{MAX_STEPS:09d}.pt" in committed
    for key in committed:  # every replica commit is the first tier's, byte for byte
        assert read_manifest(replica, key)[1] == read_manifest(fast, key)[1]
    objects = sorted(p.name for p in durable.glob("step*.pt"))
    assert objects == committed  # the killed copy's leftovers were replaced, none remain
    every = sorted(p.name for p in durable.iterdir() if p.name.startswith("step"))
    assert every == sorted(k for key in committed for k in checkpoint_objects(replica, key))
    if parts > 1:
        assert len(checkpoint_objects(replica, name)) == parts + 2  # parts, index, manifest


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

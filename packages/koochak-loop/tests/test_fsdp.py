"""FSDP2 for real: gloo worlds of 1, 2 and 4 processes on CPU run ``fsdp_world.py``.

Each world is started once per scenario group (process start-up is what costs on this machine)
and runs several training_loop runs in a row; the tests below read what they wrote:

- the same run on 1, 2 and 4 ranks (and on one process without FSDP) ends at the same weights;
- all 9 pairs of saving on W and resuming on W' in {1, 2, 4}: the restored parameters,
  optimizer state and EMA shadows, gathered, equal the saved ones exactly; on W' = W the run
  ends bit-identical to the uninterrupted one; every sample id is consumed exactly once, in the
  uninterrupted order when W' = W;
- a single-process checkpoint resumes under FSDP and an FSDP one without it;
- grad accumulation reduces gradients once per update; the gate measures the norm of all shards
  (the overflow fallback too) and every rank raises on a NaN another rank produced;
- a damaged part is never selected; a part gone after selection, or a read stalled on one rank,
  fails the load on every rank naming the part;
- an evacuation asked of one rank saves once and exits 75 on every rank;
- eval with the EMA swapped in leaves training bit-identical; bf16 mixed precision, train.amp
  (autocast) and compile run.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the repository: examples/fsdp is run from there
sys.path.insert(0, str(HERE))
import fsdp_world as world  # noqa: E402

LAUNCHES = [
    (1, ["save", "plain", "resume1", "resumeplain"]),
    (2, ["save", "async", "resume1", "resume2", "resumeplain", "damaged", "accum", "evacuate",
         "nan", "overflow", "eval", "bf16", "amp", "cli4"]),  # the CLI ends the process: last
    (4, ["save", "resume1", "resume2", "resume4"]),
    (1, ["resume2", "resume4", "back2", "back4", "export", "cli6"]),
    (2, ["resume4", "compile"]),
]  # fmt: skip
PAIRS = [(w, v) for w in (1, 2, 4) for v in (1, 2, 4)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, size: int, scenarios: list[str]) -> None:
    port = _port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "fsdp_world.py"), str(out), *scenarios], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        ))  # fmt: skip
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise AssertionError(f"world of {size} {scenarios} failed:\n" + "\n".join(logs)[-8000:])


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    for size, scenarios in LAUNCHES:
        _launch(out, size, scenarios)
    return out


def _seen(out: Path, name: str) -> list[dict]:
    """Every rank's record of run ``name``: exit code, sample ids, logged metrics."""
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}.seen.*.json"))]


def _final(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.final.pt", weights_only=True)


def _positions(entries, world_size: int, steps: range) -> dict[int, int]:
    """Global stream position -> record id, for the micro-batches of ``steps``."""
    local = world.GLOBAL_BATCH // world_size
    found: dict[int, int] = {}
    for step, micro, rank, *ids in entries:
        if step not in steps:
            continue
        first = (step * 2 + micro) * world.GLOBAL_BATCH + rank * local
        for j, record in enumerate(ids):
            assert first + j not in found, f"position {first + j} consumed twice"
            found[first + j] = record
    return found


def _ids(out: Path, name: str, world_size: int, steps: range) -> dict[int, int]:
    found: dict[int, int] = {}
    for rank_log in _seen(out, name):
        assert rank_log["code"] == 0, rank_log
        part = _positions(rank_log["seen"], world_size, steps)
        assert not set(part) & set(found)
        found.update(part)
    return found


def _close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=atol, rtol=0), key


def test_the_same_run_on_1_2_and_4_ranks_and_without_fsdp_ends_at_the_same_weights(out):
    plain = _final(out, "plain")["model"]
    for w in (1, 2, 4):
        _close(_final(out, f"save{w}")["model"], plain, atol=1e-5)


@pytest.mark.parametrize(("saved", "resumed"), PAIRS)
def test_resume_on_another_world_size_restores_exactly(out, saved, resumed):
    problems = json.loads((out / f"resume{saved}to{resumed}.restore.json").read_text())["problems"]
    assert problems == []


@pytest.mark.parametrize(("saved", "resumed"), PAIRS)
def test_every_sample_is_consumed_exactly_once_across_the_resume(out, saved, resumed):
    before = _ids(out, f"save{saved}", saved, range(world.SAVE_AT + 1))
    after = _ids(
        out, f"resume{saved}to{resumed}", resumed, range(world.SAVE_AT + 1, world.MAX_STEPS)
    )
    assert not set(before) & set(after)
    stream = {**before, **after}
    total = world.MAX_STEPS * 2 * world.GLOBAL_BATCH
    assert sorted(stream) == list(range(total))  # no position skipped or repeated
    epochs = [Counter(stream[p] for p in range(e * world.RECORDS, min(total, (e + 1) * world.RECORDS)))
              for e in range(math.ceil(total / world.RECORDS))]  # fmt: skip
    for e, counts in enumerate(epochs):
        assert max(counts.values()) == 1, f"epoch {e}: a record was consumed twice"
    for counts in epochs[:-1]:
        assert sorted(counts) == list(range(world.RECORDS)), "a full epoch skipped a record"
    if saved == resumed:  # and exactly the uninterrupted order
        assert after == _ids(out, f"save{saved}", saved, range(world.SAVE_AT + 1, world.MAX_STEPS))


@pytest.mark.parametrize("w", (1, 2, 4))
def test_resume_on_the_same_world_size_is_bit_identical(out, w):
    uninterrupted, resumed = _final(out, f"save{w}"), _final(out, f"resume{w}to{w}")
    for part in ("model", "ema"):
        assert world.diff(uninterrupted[part], resumed[part], part) == []
    assert (
        world.diff(uninterrupted["optimizer"]["state"], resumed["optimizer"]["state"], "opt") == []
    )
    assert uninterrupted["data"] == resumed["data"]


@pytest.mark.parametrize("resumed", (1, 2))
def test_a_single_process_checkpoint_resumes_under_fsdp(out, resumed):
    problems = json.loads((out / f"resumeplainto{resumed}.restore.json").read_text())["problems"]
    assert problems == []
    _close(_final(out, f"resumeplainto{resumed}")["model"], _final(out, "plain")["model"], 1e-5)


@pytest.mark.parametrize("saved", (2, 4))
def test_an_fsdp_checkpoint_loads_without_fsdp(out, saved):
    assert json.loads((out / f"back{saved}.restore.json").read_text())["problems"] == []


def test_a_background_save_publishes_the_state_of_its_step(out):
    from koochak.loop.checkpoint import checkpoint_name, load

    name = checkpoint_name(world.SAVE_AT)
    sync, background = load(out / "save2" / name), load(out / "async2" / name)
    for part in ("model", "ema"):
        assert world.diff(sync[part], background[part], part) == []
    assert world.diff(sync["optimizer"]["state"], background["optimizer"]["state"], "opt") == []
    assert world.diff(_final(out, "save2")["model"], _final(out, "async2")["model"], "final") == []


def test_a_checkpoint_with_a_damaged_part_is_never_selected(out):
    for rank in (0, 1):
        found = json.loads((out / f"damaged.{rank}.json").read_text())
        assert found["chosen"].endswith(f"step{world.SAVE_AT:09d}.pt")  # not the newer, damaged one


def test_a_load_that_cannot_complete_fails_on_every_rank_naming_the_part(out):
    part = f"step{world.SAVE_AT:09d}.pt.part-00001-00000"
    for rank in (0, 1):
        found = json.loads((out / f"damaged.{rank}.json").read_text())
        assert found["first"] is None  # the selection's verified bytes: the part is not read again
        error = found["error"]  # a second load reads the store
        assert error.startswith("ShardedLoadError") and f"part {part} is missing" in error


def test_a_part_read_stalled_on_one_rank_fails_the_load_on_every_rank_naming_it(out):
    part = f"step{world.SAVE_AT:09d}.pt.part-00001-00000"
    for rank in (0, 1):  # rank 0 never reads that part, and does not wait forever either
        error = json.loads((out / f"damaged.{rank}.json").read_text())["stalled"]
        assert error.startswith("ShardedLoadError") and "rank 1: TimeoutError" in error
        assert f"part {part} made no progress" in error


def test_an_fsdp_checkpoint_exports_to_one_weights_only_file(out):
    final = _final(out, "save4")
    model = torch.load(out / "export" / "model.pt", weights_only=True)
    assert world.diff(final["model"], model, "model") == []
    shadow = torch.load(out / "export" / "ema.pt", weights_only=True)
    assert world.diff(final["ema"]["shadows"][0]["state_dict"], shadow, "ema") == []
    fresh = world.make_model()
    fresh.load_state_dict(model)


def test_koochak_train_runs_examples_fsdp_and_resumes_it_on_another_world_size(out):
    from koochak.loop.checkpoint import resolve_auto_resume
    from koochak.loop.logging import read_jsonl_log

    records = [r for r in read_jsonl_log(out / "cli" / "log.jsonl") if r["event"] == "log"]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]  # 2 ranks to 4, then 1 rank on
    _, ckpt = resolve_auto_resume(out / "cli")
    assert (ckpt["step"], ckpt["world_size"]) == (6, 1)
    assert ckpt["data"]["cursor"] == 6 * 2 * 16  # updates x grad_accum x data.batch_size


def test_logged_metrics_are_the_mean_over_ranks(out):
    ranks = [[e for e in log["logs"] if "loss" in e] for log in _seen(out, "save2")]
    assert [e["loss"] for e in ranks[0]] == [e["loss"] for e in ranks[1]]
    assert len(ranks[0]) == world.MAX_STEPS


def test_grad_accumulation_reduces_gradients_once_per_update(out):
    counted = json.loads((out / "accum.reductions.json").read_text())
    assert counted["calls"] == counted["updates"] * counted["groups"]


def test_an_evacuation_asked_of_one_rank_saves_and_exits_75_on_every_rank(out):
    from koochak.loop.checkpoint import resolve_auto_resume

    assert [log["code"] for log in _seen(out, "evacuate")] == [75, 75]
    path, ckpt = resolve_auto_resume(out / "evacuate")
    assert (ckpt["reason"], ckpt["step"], ckpt["next_step"]) == ("evacuation", 3, 3)
    assert ckpt["data"]["cursor"] == 3 * 2 * world.GLOBAL_BATCH


def test_a_nan_on_one_rank_stops_every_rank(out):
    logs = _seen(out, "nan")
    assert [log["code"] for log in logs] == [1, 1]
    assert all(
        "NonFiniteGradientError" in log["error"] and "step 1" in log["error"] for log in logs
    )


def test_the_overflow_fallback_measures_the_norm_of_every_shard(out):
    logs = _seen(out, "overflow")
    assert [log["code"] for log in logs] == [0, 0]
    first = [log["logs"][0] for log in logs]
    assert all(entry["grad_norm_rescaled"] == 1.0 for entry in first)
    assert first[0]["grad_norm"] == first[1]["grad_norm"]  # one global figure on both ranks
    # Its plain sum of squares overflows float32: only the scaled reduction can measure it.
    assert math.isfinite(first[0]["grad_norm"])
    assert first[0]["grad_norm"] > math.sqrt(torch.finfo(torch.float32).max)


def test_eval_with_the_ema_swapped_in_leaves_training_unchanged(out):
    a, b = _final(out, "noeval"), _final(out, "witheval")
    assert world.diff(a["model"], b["model"], "model") == []
    evals = [entry["eval_at"] for entry in _seen(out, "witheval")[0]["logs"] if "eval_at" in entry]
    assert evals == [1, 3, 5]


def test_bf16_mixed_precision_trains(out):
    logs = _seen(out, "bf16")
    assert [log["code"] for log in logs] == [0, 0]
    assert all(math.isfinite(entry["loss"]) for entry in logs[0]["logs"] if "loss" in entry)
    assert all(t.dtype == torch.float32 for t in _final(out, "bf16")["model"].values())


def test_amp_autocasts_step_fn_under_fsdp(out):
    logs = _seen(out, "amp")
    assert [log["code"] for log in logs] == [0, 0]
    assert all(log["dtypes"] == ["torch.bfloat16"] for log in logs)
    assert all(math.isfinite(entry["loss"]) for entry in logs[0]["logs"] if "loss" in entry)
    assert all(t.dtype == torch.float32 for t in _final(out, "amp")["model"].values())


def test_compiled_fsdp_trains_like_eager(out):
    compiled = [e for e in _seen(out, "compile")[0]["logs"] if "loss" in e]
    eager = [e for e in _seen(out, "save2")[0]["logs"] if "loss" in e][: len(compiled)]
    assert [round(e["loss"], 4) for e in compiled] == [round(e["loss"], 4) for e in eager]


def test_each_ranks_rng_state_is_its_own_part_read_only_by_the_rank_that_restores_it(
    out, monkeypatch
):
    from koochak.loop.checkpoint import load, rng_state_for_rank
    from koochak.loop.checkpoint.index_fragments import parse_head
    from koochak.loop.checkpoint.parts_tree import load_skeleton
    from koochak.loop.checkpoint.selection import open_candidate
    from koochak.storage.store import LocalStore

    name = f"step{world.SAVE_AT:09d}.pt"
    head = parse_head((out / "save2" / name).read_bytes(), name, name)
    skeleton = load_skeleton(head.skeleton, name)
    assert skeleton["rng_per_rank"] is None  # nothing gathered: rank 0's own state only
    assert skeleton["rng"] is not None
    zero = json.loads((out / "save2" / f"{name}.part-00000-index").read_text())
    one = json.loads((out / "save2" / f"{name}.part-00001-index").read_text())
    assert "rng" not in zero and one["rng"] == len(one["parts"]) - 1  # its last part
    assert len(one["parts"][-1]["key"]) < 100 and head.fragments[1].size < 2000  # no base64
    rng_key = one["parts"][-1]["key"]
    states = load(out / "save2" / name)["rng_per_rank"]  # one process: every writer's
    assert len(states) == 2 and all(state is not None for state in states)

    store = LocalStore(str(out / "save2"))
    opened, real_get = [], LocalStore.get
    monkeypatch.setattr(
        LocalStore, "get", lambda self, key, *a: opened.append(key) or real_get(self, key, *a)
    )
    _, ckpt = open_candidate(store, name, rank=1, world=2)  # rank 1 reads its own
    assert rng_key in opened
    mine = rng_state_for_rank(ckpt, 1)
    assert torch.equal(mine["torch"], states[1]["torch"]) and mine["python"] == states[1]["python"]
    opened.clear()
    _, ckpt = open_candidate(store, name, rank=0, world=1)  # on 1 rank: rows of both writers
    assert rng_key not in opened and f"{name}.part-00001-index" in opened
    assert torch.equal(rng_state_for_rank(ckpt, 0)["torch"], states[0]["torch"])

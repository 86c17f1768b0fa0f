"""Small loop helpers: precision, device, batch, prefetch, dist (single process)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from koochak.loop import dist
from koochak.loop.batch import cycle, shuffled_batches, take, to_device
from koochak.loop.device import get_device, get_lr
from koochak.loop.precision import Scaler, autocast_context, check_amp_mode
from koochak.loop.prefetch import cuda_prefetch


def test_amp_modes_and_autocast_on_cpu():
    assert check_amp_mode(None) == "none" and check_amp_mode("BF16") == "bf16"
    with pytest.raises(ValueError, match="train.amp: expected one of none|bf16|fp16, got 'fp8'"):
        check_amp_mode("fp8")
    layer = torch.nn.Linear(2, 2)
    with autocast_context("bf16", "cpu"):
        assert layer(torch.ones(1, 2)).dtype == torch.bfloat16
    with autocast_context("none", "cpu"):
        assert layer(torch.ones(1, 2)).dtype == torch.float32


def test_bf16_on_a_cpu_without_native_bf16_warns_once_per_run(tmp_path, monkeypatch, recwarn):
    from koochak.loop import precision, training_loop

    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: False)
    model = torch.nn.Linear(2, 1)
    batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3

    def step_fn(model, batch, ctx):
        return {"loss": model(batch[0]).float().square().mean()}

    training_loop(model=model, dataset=batches, step_fn=step_fn,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  train_cfg={"max_steps": 3, "amp": "bf16", "device": "cpu",
                             "out_dir": str(tmp_path)})  # fmt: skip
    slow = [w for w in recwarn.list if "without native bfloat16" in str(w.message)]
    assert len(slow) == 1 and "set train.amp: none" in str(slow[0].message)

    recwarn.clear()
    precision.autocast_factory("none", "cpu")
    precision.autocast_factory("bf16", "cuda")  # only the CPU emulates
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: True)
    precision.autocast_factory("bf16", "cpu")
    monkeypatch.setattr(precision, "cpu_native_bf16", lambda: None)  # cannot tell: say nothing
    precision.autocast_factory("bf16", "cpu")
    assert not [w for w in recwarn.list if "bfloat16" in str(w.message)]


def test_cpu_native_bf16_answers_on_this_machine():
    from koochak.loop.precision import cpu_native_bf16

    assert cpu_native_bf16() in (True, False, None)


def test_scaler_is_a_pass_through_off_cuda():
    for mode in ("none", "bf16", "fp16"):
        scaler = Scaler(mode, "cpu")
        assert scaler.enabled is False and scaler.state_dict() is None
        loss = torch.tensor(2.0)
        assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    param = torch.nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    opt = torch.optim.SGD([param], lr=0.5)
    scaler = Scaler("fp16", "cpu")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert float(param.detach()) == 0.5


def test_get_device_and_lr():
    assert get_device("cpu") == torch.device("cpu")
    assert get_device({"device": "cpu"}) == torch.device("cpu")
    assert get_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="train.device: expected auto|cpu|cuda|cuda:N, got 'gpu'"):
        get_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            get_device("cuda:0")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.25)
    assert get_lr(opt) == 0.25


def test_to_device_walks_nested_batches():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(1), (torch.zeros(2), "tag")], "p": Pair(torch.ones(3), 4)}
    moved = to_device(batch, "cpu")
    assert moved["a"][1][1] == "tag" and isinstance(moved["p"], Pair) and moved["p"].y == 4
    assert torch.equal(moved["p"].x, torch.ones(3))
    assert isinstance(to_device(OrderedDict(a=torch.ones(1)), "cpu"), OrderedDict)


def test_cycle_reiterates_without_caching_and_take():
    calls = []

    class Reiterable:
        def __iter__(self):
            calls.append(1)
            return iter([1, 2])

    assert list(take(cycle(Reiterable()), 5)) == [1, 2, 1, 2, 1]
    assert len(calls) == 3
    with pytest.raises(ValueError, match="no items"):
        next(cycle([]))
    assert list(take(range(3), 10)) == [0, 1, 2]
    with pytest.raises(ValueError):
        take([], -1)


def test_cuda_prefetch_off_cuda_is_a_pass_through_with_prepare():
    data = [(torch.full((2,), float(i)), i) for i in range(4)]
    out = list(cuda_prefetch(data, "cpu", lambda b: (b[0] * 2, b[1])))
    assert [b[1] for b in out] == [0, 1, 2, 3]
    assert torch.equal(out[3][0], torch.full((2,), 6.0))
    assert list(cuda_prefetch([], "cpu")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetch_on_cuda_delivers_every_batch_on_the_device():
    data = [{"x": torch.full((1024,), float(i))} for i in range(5)]
    out = list(cuda_prefetch(data, "cuda"))
    assert [float(b["x"][0]) for b in out] == [0, 1, 2, 3, 4]
    assert all(b["x"].is_cuda for b in out)


def test_dist_single_process_answers():
    assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.is_rank0()
    assert dist.is_initialized() is False
    dist.barrier()
    assert dist.all_gather_floats([1.5]) == [[1.5]]


def test_init_process_group_without_launcher_env_names_what_is_missing(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        dist.init_process_group()


def test_shuffled_batches_cover_each_pass_and_resume_at_any_batch():
    full = list(take(shuffled_batches(10, 3, seed=7), 9))  # 3 full batches a pass, 3 passes
    for p in range(3):
        seen = torch.cat(full[3 * p : 3 * p + 3])
        assert len(set(seen.tolist())) == 9  # no repeats within a pass; one item left out
    assert not torch.equal(torch.cat(full[:3]), torch.cat(full[3:6]))  # each pass reshuffled
    for start in (0, 2, 3, 7):
        resumed = list(take(shuffled_batches(10, 3, seed=7, start=start), 9 - start))
        assert all(torch.equal(a, b) for a, b in zip(resumed, full[start:]))
    other = next(shuffled_batches(10, 3, seed=8))
    assert not torch.equal(other, full[0])


def test_shuffled_batches_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    list(take(shuffled_batches(100, 10, seed=0), 25))
    assert torch.equal(torch.get_rng_state(), state)


def test_shuffled_batches_reject_impossible_sizes():
    with pytest.raises(ValueError, match="batch_size=5 for 4 items"):
        next(shuffled_batches(4, 5, seed=0))
    with pytest.raises(ValueError, match="start must be >= 0"):
        next(shuffled_batches(4, 2, seed=0, start=-1))


def test_next_due_is_the_first_update_ending_a_cadence_or_the_last():
    from koochak.loop.loop import _next_due

    assert _next_due(0, [50], None) == 49
    assert _next_due(49, [50], None) == 49 and _next_due(50, [50], None) == 99
    assert _next_due(50, [50, 7], None) == 55  # (55 + 1) % 7 == 0
    assert _next_due(0, [50], 10) == 9  # the last update is always due
    assert _next_due(12, [], 20) == 19
    for step in range(40):  # agrees with the modulo definition everywhere
        want = min(s for s in range(step, 100) if (s + 1) % 3 == 0 or (s + 1) % 8 == 0)
        assert _next_due(step, [3, 8], None) == want


def test_to_device_pairs_keep_their_kind():
    t = torch.ones(2)
    Pair = namedtuple("Pair", "x y")
    moved = to_device((t, t), "cpu")
    assert type(moved) is tuple and moved[0] is t  # already there: Tensor.to is a no-op
    assert to_device((t, {"a": t}), "cpu") == (t, {"a": t})
    assert type(to_device(Pair(t, t), "cpu")) is Pair  # a named pair stays named
    assert to_device([t, t], "cpu") == [t, t] and to_device((t, "label"), "cpu") == (t, "label")

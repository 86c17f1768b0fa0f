"""training_loop: run order, accumulation, gradient gate, hooks, eval, checkpoints, resume."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
from koochak.loop import training_loop
from koochak.loop.gradients import NonFiniteGradientError
from torch import nn
from torch.nn import functional as F


def regression_batches(n_batches: int, batch_size: int = 8, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 1, generator=gen)
    out = []
    for _ in range(n_batches):
        x = torch.randn(batch_size, 4, generator=gen)
        out.append((x, x @ w + 0.1 * torch.randn(batch_size, 1, generator=gen)))
    return out


def mse_step(model, batch, ctx):
    x, y = batch
    pred = model(x)
    return {"loss": F.mse_loss(pred, y), "mae": (pred - y).abs().mean()}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def cfg(tmp_path, **kw):
    base = {"max_steps": 10, "log_every": 5, "out_dir": str(tmp_path / "run"), "device": "cpu"}
    base.update(kw)
    return base


def sgd_loop(model: nn.Module, dataset, step_fn, **kwargs) -> dict:
    """training_loop with plain SGD (lr 0.1), the optimizer most tests here need."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return training_loop(
        model=model, dataset=dataset, step_fn=step_fn, optimizer=optimizer, **kwargs
    )


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_grad_accum_of_k_micro_batches_equals_one_k_times_batch(tmp_path):
    micro = regression_batches(12, batch_size=4)
    big = [
        (torch.cat([b[0] for b in micro[i : i + 4]]), torch.cat([b[1] for b in micro[i : i + 4]]))
        for i in range(0, 12, 4)
    ]
    a, b = make_model(), make_model()
    training_loop(
        model=a,
        dataset=micro,
        step_fn=mse_step,
        optimizer=torch.optim.SGD(a.parameters(), lr=0.5),
        train_cfg=cfg(tmp_path / "a", max_steps=3, grad_accum=4),
    )
    training_loop(
        model=b,
        dataset=big,
        step_fn=mse_step,
        optimizer=torch.optim.SGD(b.parameters(), lr=0.5),
        train_cfg=cfg(tmp_path / "b", max_steps=3),
    )
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    # and they actually moved
    assert not torch.allclose(next(a.parameters()), next(make_model().parameters()))


def test_finite_dataset_stops_when_exhausted_without_hidden_epochs(tmp_path):
    pulled = []

    def data():
        for i, batch in enumerate(regression_batches(7)):
            pulled.append(i)
            yield batch

    model = make_model()
    logged = []
    ckpt = sgd_loop(
        model,
        data(),
        mse_step,
        train_cfg=cfg(tmp_path, max_steps=None, log_every=5),
        hooks={"on_log": [lambda info: logged.append((info["step"], info["metrics"]["loss"]))]},
    )
    assert pulled == list(range(7))
    assert ckpt["step"] == 7 and ckpt["next_step"] == 7
    # the last update is logged even though only the exhausted data said it was the last
    assert [step for step, _ in logged] == [4, 6]
    assert ckpt["metrics"]["loss"] == logged[-1][1]


def test_infinite_iterable_stops_at_max_steps(tmp_path):
    batches = regression_batches(3)
    model = make_model()
    seen = []
    ckpt = sgd_loop(
        model,
        (batches[i % 3] for i in itertools.count()),
        mse_step,
        train_cfg=cfg(tmp_path, max_steps=13),
        hooks={"on_step_end": [lambda info: seen.append(info["step"])]},
    )
    assert seen == list(range(13))
    assert ckpt["step"] == 13


def test_hook_events_order_and_info(tmp_path):
    events = []

    def rec(name):
        return lambda info: events.append((name, info))

    hooks = {
        e: [rec(e)]
        for e in ("on_train_start", "on_log", "on_eval_end", "on_checkpoint", "on_train_end")
    }
    model = make_model()
    sgd_loop(
        model,
        regression_batches(12),
        mse_step,
        train_cfg=cfg(
            tmp_path, max_steps=12, log_every=5, eval_every=6, ckpt_every=6, eval_at_step_zero=True
        ),
        eval_dataset=regression_batches(2, seed=1),
        eval_fn=lambda m, ds, ctx: {"loss": sum(F.mse_loss(m(x), y) for x, y in ds) / len(ds)},
        hooks=hooks,
        config_json={"train": {"max_steps": 12}},
    )
    names = [(n, i["step"]) for n, i in events]
    assert names == [
        ("on_train_start", 0),
        ("on_eval_end", 0),
        ("on_log", 4),
        ("on_eval_end", 5),
        ("on_checkpoint", 5),
        ("on_log", 9),
        ("on_log", 11),
        ("on_eval_end", 11),
        ("on_checkpoint", 12),  # no periodic save at 11: the terminal one of the same state follows
        ("on_train_end", 12),
    ]
    start = events[0][1]
    assert {
        "step",
        "max_steps",
        "train_cfg",
        "config_json",
        "model",
        "num_params",
        "rank",
        "world_size",
        "out_dir",
    } <= set(start)
    assert start["num_params"] == sum(p.numel() for p in model.parameters())
    assert start["rank"] == 0 and start["world_size"] == 1 and start["max_steps"] == 12
    log = dict(events)["on_log"]["metrics"]
    assert {"loss", "mae", "lr", "grad_norm", "step_time_s", "samples_per_s"} <= set(log)
    assert all(isinstance(v, float) for v in log.values())
    assert set(dict(events)["on_eval_end"]["metrics"]) == {"eval_loss"}
    ckpt_info = [i for n, i in events if n == "on_checkpoint"]
    assert [c["checkpoint"]["next_step"] for c in ckpt_info] == [6, 12]
    assert ckpt_info[0]["path"].endswith("step000000005.pt")
    assert ckpt_info[-1]["path"].endswith("step000000012.pt")


def test_last_update_publishes_only_the_terminal_checkpoint(tmp_path):
    """ckpt_every dividing max_steps: one save of the final state (step{N}.pt), not two."""
    saved = []
    model = make_model()
    sgd_loop(
        model,
        regression_batches(8),
        mse_step,
        train_cfg=cfg(tmp_path, max_steps=8, ckpt_every=4, keep_last_k=None),
        hooks={"on_checkpoint": [lambda info: saved.append(info["path"].rsplit("/", 1)[-1])]},
    )
    assert saved == ["step000000003.pt", "step000000008.pt"]
    assert sorted(p.name for p in (tmp_path / "run").glob("step*.pt")) == saved


def test_data_running_out_keeps_the_periodic_checkpoint(tmp_path):
    """Without max_steps the loop cannot know an update is the last one: periodic saves stay."""
    model = make_model()
    sgd_loop(
        model,
        regression_batches(4),
        mse_step,
        train_cfg=cfg(tmp_path, max_steps=None, ckpt_every=2, keep_last_k=None),
    )
    names = sorted(p.name for p in (tmp_path / "run").glob("step*.pt"))
    assert names == ["step000000001.pt", "step000000003.pt", "step000000004.pt"]


def test_checkpoint_dict_contents_and_published_file(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    ckpt = training_loop(
        model=model,
        dataset=regression_batches(5),
        step_fn=mse_step,
        optimizer=opt,
        scheduler=sched,
        train_cfg=cfg(tmp_path),
        config_json={"train": {"x": 1}},
    )
    assert {
        "step",
        "next_step",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "config",
        "rng",
        "wall_time",
        "metrics",
    } <= set(ckpt)
    assert ckpt["config"] == {"train": {"x": 1}}
    assert ckpt["scheduler"]["last_epoch"] == 5
    saved = torch.load(tmp_path / "run" / "step000000005.pt", weights_only=True)
    assert saved["step"] == 5
    for key, value in ckpt["model"].items():
        torch.testing.assert_close(saved["model"][key], value)
    assert (tmp_path / "run" / "step000000005.pt.ready.json").exists()


def test_resume_from_returned_checkpoint_continues_the_same_run(tmp_path):
    # Dropout makes the result depend on the RNG, which the checkpoint must carry.
    def build():
        torch.manual_seed(3)
        m = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 1))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    data = regression_batches(10)
    ref, ref_opt = build()
    training_loop(
        model=ref,
        dataset=data,
        step_fn=mse_step,
        optimizer=ref_opt,
        train_cfg=cfg(tmp_path / "ref", max_steps=10),
    )

    first, first_opt = build()
    ckpt = training_loop(
        model=first,
        dataset=data,
        step_fn=mse_step,
        optimizer=first_opt,
        train_cfg=cfg(tmp_path / "a", max_steps=4),
    )
    ckpt = copy.deepcopy(ckpt)
    torch.manual_seed(999)  # a fresh process would have a different RNG state
    second, second_opt = build()
    torch.manual_seed(12345)
    training_loop(
        model=second,
        dataset=data[ckpt["next_step"] :],
        step_fn=mse_step,
        optimizer=second_opt,
        train_cfg=cfg(tmp_path / "b", max_steps=10),
        checkpoint_dict=ckpt,
    )
    for pa, pb in zip(ref.parameters(), second.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def nan_at(step_to_break: int):
    def step_fn(model, batch, ctx):
        out = mse_step(model, batch, ctx)
        if ctx.step == step_to_break:
            out["loss"] = out["loss"] * float("nan")
        return out

    return step_fn


def test_nan_gradient_rejected_before_the_optimizer_step(tmp_path):
    model = make_model()
    snapshots = {}
    hooks = {"on_step_end": [lambda info: snapshots.__setitem__(info["step"], params_of(model))]}
    exceptions = []
    hooks["on_exception"] = [lambda info: exceptions.append(info)]
    with pytest.raises(NonFiniteGradientError, match=r"step 3: .*parameter '0\.weight'"):
        sgd_loop(
            model,
            regression_batches(10),
            nan_at(3),
            train_cfg=cfg(tmp_path, grad_clip=1.0),
            hooks=hooks,
        )
    for before, after in zip(snapshots[2], params_of(model)):
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert exceptions and exceptions[0]["step"] == 3


def test_nan_without_clipping_is_caught_on_logging_steps(tmp_path):
    model = make_model()
    with pytest.raises(NonFiniteGradientError, match="step 4"):
        sgd_loop(
            model,
            regression_batches(10),
            nan_at(4),
            train_cfg=cfg(tmp_path, log_every=5),
        )


def test_nonfinite_grad_check_every_raises_instead_of_zeroing(tmp_path):
    model = make_model()
    with pytest.raises(NonFiniteGradientError, match="step 1: .*nonfinite_grad_check_every"):
        sgd_loop(
            model,
            regression_batches(10),
            nan_at(1),
            train_cfg=cfg(tmp_path, log_every=100, nonfinite_grad_check_every=1),
        )


def test_clipping_matches_torch_clip_grad_norm(tmp_path):
    data = regression_batches(3)
    a = make_model()
    logs = []
    training_loop(
        model=a,
        dataset=data,
        step_fn=lambda m, b, c: {"loss": 100 * mse_step(m, b, c)["loss"]},
        optimizer=torch.optim.SGD(a.parameters(), lr=0.01),
        train_cfg=cfg(tmp_path, max_steps=3, log_every=1, grad_clip=0.5),
        hooks={"on_log": [lambda info: logs.append(info["metrics"])]},
    )
    b = make_model()
    opt = torch.optim.SGD(b.parameters(), lr=0.01)
    norms = []
    for x, y in data:
        (100 * F.mse_loss(b(x), y)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)
    assert [m["grad_norm"] for m in logs] == pytest.approx(norms, rel=1e-5)
    assert all(m["grad_clip_coefficient"] < 1 and "grad_norm_rescaled" not in m for m in logs)
    assert [m["grad_clip_scaled_norm"] for m in logs] == pytest.approx([0.5] * len(logs), rel=1e-4)


def test_failing_logging_hook_warns_once_and_training_continues(tmp_path):
    calls = []

    def broken(info):
        calls.append(info["step"])
        raise OSError("disk full")

    model = make_model()
    with pytest.warns(RuntimeWarning, match="disk full") as record:
        ckpt = sgd_loop(
            model,
            regression_batches(10),
            mse_step,
            train_cfg=cfg(tmp_path, log_every=2),
            hooks={"on_log": [broken]},
        )
    assert ckpt["step"] == 10
    assert calls == [1, 3, 5, 7, 9]
    assert sum("disk full" in str(w.message) for w in record) == 1


def test_failing_train_start_hook_aborts(tmp_path):
    model = make_model()

    def broken(info):
        raise RuntimeError("cannot reach tracker")

    with pytest.raises(RuntimeError, match="cannot reach tracker"):
        sgd_loop(
            model,
            regression_batches(3),
            mse_step,
            train_cfg=cfg(tmp_path),
            hooks={"on_train_start": [broken]},
        )
    # Nothing trained or saved: only the run's claim on its location (its tier marker) is there.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["koochak-tier.json"]


def test_fail_closed_hook_aborts_training(tmp_path):
    from koochak.loop.hooks import fail_closed

    def strict(info):
        if info["step"] == 1:
            raise ValueError("ack rejected")

    model = make_model()
    with pytest.raises(ValueError, match="ack rejected"):
        sgd_loop(
            model,
            regression_batches(5),
            mse_step,
            train_cfg=cfg(tmp_path),
            hooks={"on_step_end": [fail_closed(strict)]},
        )


def test_scheduler_steps_per_update_or_per_eval(tmp_path):
    for mode, expected in (("update", 6), ("eval", 3)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        training_loop(
            model=model,
            dataset=regression_batches(6),
            step_fn=mse_step,
            optimizer=opt,
            scheduler=sched,
            train_cfg=cfg(tmp_path / mode, scheduler_step=mode, eval_every=2),
            eval_dataset=[0],
            eval_fn=lambda m, d, c: {"loss": 1.0},
        )
        assert sched.last_epoch == expected
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5**expected)


def test_eval_runs_in_eval_mode_without_grad_and_restores_train_mode(tmp_path):
    seen = []

    def eval_fn(model, data, ctx):
        seen.append((model.training, torch.is_grad_enabled(), ctx.step))
        return {"eval_acc": 1.0}

    model = make_model()
    modes = []
    sgd_loop(
        model,
        regression_batches(4),
        lambda m, b, c: modes.append(m.training) or mse_step(m, b, c),
        train_cfg=cfg(tmp_path, eval_every=2),
        eval_dataset=[],
        eval_fn=eval_fn,
    )
    assert seen == [(False, False, 1), (False, False, 3)]
    assert modes == [True] * 4


def test_ctx_carries_device_rank_autocast_scaler_config_and_step(tmp_path):
    seen = []

    def step_fn(model, batch, ctx):
        seen.append((ctx.step, ctx.micro_step))
        assert ctx.device == torch.device("cpu") and ctx["rank"] == 0 and ctx.world_size == 1
        assert ctx.config_json == {"a": 1} and ctx.train_cfg["grad_accum"] == 2
        assert ctx.scaler.enabled is False
        with ctx.autocast():
            pass
        return mse_step(model, batch, ctx)

    model = make_model()
    sgd_loop(
        model,
        regression_batches(4),
        step_fn,
        train_cfg=cfg(tmp_path, grad_accum=2),
        config_json={"a": 1},
    )
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_bf16_autocast_on_cpu_trains(tmp_path):
    dtypes = []

    def step_fn(model, batch, ctx):
        x, y = batch
        pred = model(x)
        dtypes.append(pred.dtype)
        return {"loss": F.mse_loss(pred.float(), y)}

    model = make_model()
    ckpt = sgd_loop(
        model,
        regression_batches(3),
        step_fn,
        train_cfg=cfg(tmp_path, amp="bf16"),
    )
    assert dtypes == [torch.bfloat16] * 3
    assert ckpt["scaler"] is None and math.isfinite(ckpt["metrics"]["loss"])


def test_data_ending_inside_an_accumulation_drops_the_partial_update(tmp_path):
    model = make_model()
    before = params_of(model)
    with pytest.warns(RuntimeWarning, match="1 micro-batch"):
        ckpt = sgd_loop(
            model,
            regression_batches(1),
            mse_step,
            train_cfg=cfg(tmp_path, grad_accum=2),
        )
    assert ckpt["step"] == 0
    for a, b in zip(before, params_of(model)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_step_fn_without_loss_is_a_clear_error(tmp_path):
    model = make_model()
    with pytest.raises(TypeError, match="step_fn must return a dict with a 'loss' tensor.*'mae'"):
        sgd_loop(
            model,
            regression_batches(2),
            lambda m, b, c: {"mae": mse_step(m, b, c)["mae"]},
            train_cfg=cfg(tmp_path),
        )


def test_unknown_train_key_fails_before_training(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match=r"train\.max_stpes.*did you mean 'train\.max_steps'"):
        sgd_loop(
            model,
            regression_batches(2),
            mse_step,
            train_cfg={"max_stpes": 3, "out_dir": str(tmp_path)},
        )


def test_host_syncs_only_on_logging_steps_without_clipping(tmp_path, monkeypatch):
    counts = {"item": 0, "tolist": 0, "float": 0, "bool": 0}
    for name, attr in (
        ("item", "item"),
        ("tolist", "tolist"),
        ("float", "__float__"),
        ("bool", "__bool__"),
    ):
        original = getattr(torch.Tensor, attr)

        def counted(self, *a, _o=original, _n=name, **k):
            counts[_n] += 1
            return _o(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    syncs_at = []
    model = make_model()
    sgd_loop(
        model,
        regression_batches(10),
        mse_step,
        train_cfg=cfg(tmp_path, log_every=5, max_steps=10),
        hooks={"on_step_end": [lambda info: syncs_at.append(sum(counts.values()))]},
    )
    # One batched read per logging step (steps 4 and 9), nothing on the other eight.
    assert syncs_at == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]


def test_clipping_costs_one_sync_per_step(tmp_path, monkeypatch):
    counts = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: counts.append(1) or original(self))
    model = make_model()
    sgd_loop(
        model,
        regression_batches(6),
        mse_step,
        train_cfg=cfg(tmp_path, log_every=3, max_steps=6, grad_clip=1.0),
    )
    assert len(counts) == 4  # steps 0, 1, 3, 4; logging steps 2 and 5 read it with the metrics


def test_prepare_batch_fn_runs_on_each_batch(tmp_path):
    model = make_model()
    seen = []

    def prepare(batch):
        seen.append(batch[0].device)
        return batch[0], batch[1] * 0

    ckpt = sgd_loop(
        model,
        regression_batches(3),
        mse_step,
        train_cfg=cfg(tmp_path, cuda_prefetch=True),
        prepare_batch_fn=prepare,
    )
    assert len(seen) == 3 and ckpt["step"] == 3


def test_parameter_banner_on_rank0(tmp_path, capsys):
    model = make_model()
    sgd_loop(
        model,
        regression_batches(1),
        mse_step,
        train_cfg=cfg(tmp_path),
    )
    assert "koochak: Sequential with 49 parameters" in capsys.readouterr().out


def test_warnings_are_not_raised_on_an_ordinary_run(tmp_path):
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sgd_loop(
            model,
            regression_batches(3),
            mse_step,
            train_cfg=cfg(tmp_path),
        )


def test_compile_wraps_the_training_model_but_checkpoints_the_bare_one(tmp_path, monkeypatch):
    class Compiled(nn.Module):  # stands in for torch.compile's OptimizedModule
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

        def forward(self, x):
            return self._orig_mod(x)

    monkeypatch.setattr(torch, "compile", lambda m, **kw: Compiled(m))
    seen = []
    model = make_model()
    ckpt = sgd_loop(
        model,
        regression_batches(2),
        lambda m, b, c: seen.append(type(m).__name__) or mse_step(m, b, c),
        train_cfg=cfg(tmp_path, compile=True),
    )
    assert seen == ["Compiled", "Compiled"]
    assert set(ckpt["model"]) == set(model.state_dict())  # no _orig_mod. prefix


def test_cadences_fire_on_their_own_steps_also_after_a_resume(tmp_path):
    """Logging, eval and periodic saves with co-prime periods, from step 0 and from a resumed odd
    step: each fires exactly where ``(step + 1) % every == 0`` (and the log at the last step)."""
    def run(start_from, max_steps, out):
        events = []
        hooks = {e: [lambda info, e=e: events.append((e, info["step"]))]
                 for e in ("on_log", "on_eval_end", "on_checkpoint")}  # fmt: skip
        model = make_model()
        result = sgd_loop(
            model, regression_batches(max_steps), mse_step,
            train_cfg=cfg(out, max_steps=max_steps, log_every=3, eval_every=5, ckpt_every=4,
                          nonfinite_grad_check_every=2, keep_last_k=None),
            eval_dataset=regression_batches(1, seed=1),
            eval_fn=lambda m, ds, ctx: {"loss": sum(F.mse_loss(m(x), y) for x, y in ds)},
            hooks=hooks, checkpoint_dict=start_from,
        )  # fmt: skip
        return events, result

    def expected(first, last):
        steps = range(first, last)
        logs = [("on_log", s) for s in steps if (s + 1) % 3 == 0 or s + 1 == last]
        evals = [("on_eval_end", s) for s in steps if (s + 1) % 5 == 0]
        saves = [("on_checkpoint", s) for s in steps if (s + 1) % 4 == 0 and s + 1 != last]
        return sorted(logs + evals + saves + [("on_checkpoint", last)], key=lambda e: e[1])

    events, _ = run(None, 23, tmp_path / "a")
    assert sorted(events, key=lambda e: e[1]) == expected(0, 23)
    _, seven = run(None, 7, tmp_path / "b")
    events, _ = run(seven, 23, tmp_path / "c")
    assert sorted(events, key=lambda e: e[1]) == expected(7, 23)


def test_the_dataset_is_first_iterated_at_the_first_batch(tmp_path):
    """``iter(dataset)`` runs when the first batch is needed: after eval at step zero and after
    a resume restored the RNG (a DataLoader draws its base seed in ``__iter__``)."""
    order = []

    class Recorded:
        def __iter__(self):
            order.append("iter")
            return iter(regression_batches(3))

    def eval_fn(model, data, ctx):
        order.append("eval")
        return {"loss": 0.0}

    sgd_loop(make_model(), Recorded(), mse_step, train_cfg=cfg(tmp_path, max_steps=3,
             eval_at_step_zero=True), eval_dataset=[0], eval_fn=eval_fn)  # fmt: skip
    assert order[:2] == ["eval", "iter"]

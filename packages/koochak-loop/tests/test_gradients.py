"""Gradient gate: norm, scaled-reduction fallback, clipping, non-finite rejection."""

from __future__ import annotations

import math

import pytest
import torch
from koochak.loop.gradients import (
    NonFiniteGradientError,
    apply_gate,
    check_finite,
    grads_of,
    scaled_total_norm,
    total_norm,
)


def named(*grads):
    params = []
    for i, g in enumerate(grads):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append((f"p{i}", p))
    return params


def test_total_norm_matches_torch():
    params = named(torch.randn(5, 3), torch.randn(7))
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for _, p in params]))
    torch.testing.assert_close(total_norm(grads_of(params)), expected)


def test_overflowing_norm_falls_back_to_scaled_reduction_and_clips():
    params = named(torch.full((4,), 1e30), torch.full((9,), -1e30))
    plain = total_norm(grads_of(params))
    assert math.isinf(float(plain))  # squares overflow float32
    metrics = apply_gate(params, float(plain), max_norm=1.0, step=3)
    assert metrics["grad_norm"] == pytest.approx(1e30 * math.sqrt(13), rel=1e-5)
    assert metrics["grad_norm_rescaled"] == 1.0
    assert metrics["grad_clip_scaled_norm"] == pytest.approx(1.0, rel=1e-4)
    assert metrics["grad_clip_coefficient"] == pytest.approx(1.0 / (1e30 * math.sqrt(13)), rel=1e-5)
    clipped = float(torch.linalg.vector_norm(torch.cat([p.grad for _, p in params])))
    assert clipped == pytest.approx(1.0, rel=1e-4)


def test_scaled_norm_in_half_precision():
    g = torch.full((100,), 60000.0, dtype=torch.float16)
    assert math.isinf(float(total_norm([g])))
    assert scaled_total_norm([g]) == pytest.approx(600000.0, rel=1e-3)


def test_nan_is_rejected_naming_step_and_parameter():
    params = named(torch.ones(2), torch.tensor([1.0, float("nan")]))
    with pytest.raises(NonFiniteGradientError, match=r"step 7: .*'p1'"):
        apply_gate(params, float(total_norm(grads_of(params))), max_norm=1.0, step=7)


def test_inf_entry_is_rejected_not_rescaled():
    params = named(torch.tensor([float("inf"), 1.0]))
    with pytest.raises(NonFiniteGradientError, match="'p0'"):
        apply_gate(params, float("inf"), max_norm=None, step=0)


def test_inf_under_a_grad_scaler_skips_instead_of_raising():
    params = named(torch.tensor([float("inf"), 1.0]))
    assert apply_gate(params, float("inf"), max_norm=1.0, step=0, allow_skip=True) is None


def test_no_clip_when_norm_is_below_max():
    params = named(torch.tensor([0.3, 0.4]))
    metrics = apply_gate(params, 0.5, max_norm=1.0, step=0)
    assert metrics["grad_clip_coefficient"] == 1.0
    torch.testing.assert_close(params[0][1].grad, torch.tensor([0.3, 0.4]))


def test_check_finite_raises_rather_than_zeroing():
    params = named(torch.tensor([1.0, float("nan")]))
    with pytest.raises(NonFiniteGradientError, match="step 2"):
        check_finite(params, step=2)
    assert math.isnan(float(params[0][1].grad[1]))  # left as is, not zeroed
    check_finite(named(torch.ones(3)), step=0)


def test_grad_reader_reads_present_grads_and_knows_they_are_uniform():
    from koochak.loop.gradients import GradReader

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    reader = GradReader(list(model.named_parameters()))
    assert reader() == [] and reader.uniform and not reader.sharded
    model(torch.ones(1, 3)).sum().backward()
    grads = reader()
    assert len(grads) == 3 and all(g is p.grad for g, p in zip(grads, model.parameters()))
    model[0].bias.grad = None  # a parameter without a gradient this step is skipped
    assert len(reader()) == 2
    torch.testing.assert_close(
        total_norm(reader(), uniform=True), total_norm(grads_of(list(model.named_parameters())))
    )
    mixed = GradReader([("a", torch.nn.Parameter(torch.ones(2))),
                        ("b", torch.nn.Parameter(torch.ones(2, dtype=torch.float64)))])  # fmt: skip
    assert not mixed.uniform

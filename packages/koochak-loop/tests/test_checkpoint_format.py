"""The checkpoint dict: naming, weights-only serialization, cursors, and restoring into a model."""

from __future__ import annotations

import io
import random
import threading

import numpy as np
import pytest
import torch
from koochak.loop.checkpoint import (
    build_checkpoint,
    check_resume_cursor,
    checkpoint_name,
    deserialize_checkpoint,
    match_state_dict_to_model,
    restore_training_state,
    rng_state_for_rank,
    serialize_checkpoint,
)
from koochak.loop.checkpoint.serialization import serialize_checkpoint_chunks
from koochak.loop.seed import get_rng_state, set_rng_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained(model: torch.nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return opt, sched


def test_checkpoint_name_is_nine_digits():
    assert checkpoint_name(0) == "step000000000.pt"
    assert checkpoint_name(100000) == "step000100000.pt"
    with pytest.raises(ValueError, match="non-negative int"):
        checkpoint_name(-1)


def test_round_trip_restores_model_optimizer_scheduler_and_rng():
    model = _model()
    opt, sched = _trained(model)
    rng = get_rng_state()
    expected_draw = (random.random(), np.random.rand(), torch.rand(3))
    ckpt = build_checkpoint(
        step=2,
        next_step=3,
        model=model,
        optimizer=opt,
        scheduler=sched,
        rng=rng,
        config={"train": {"max_steps": 10}},
        wall_time=1.5,
        metrics={"loss": torch.tensor(0.25)},
    )
    loaded = deserialize_checkpoint(serialize_checkpoint(ckpt), "mem")
    assert loaded["metrics"] == {"loss": 0.25}
    assert loaded["config"] == {"train": {"max_steps": 10}}

    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    assert restore_training_state(loaded, fresh, opt2, sched2) == 3
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert sched2.last_epoch == sched.last_epoch

    set_rng_state(rng_state_for_rank(loaded, 0))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert again[0] == expected_draw[0] and again[1] == expected_draw[1]
    assert torch.equal(again[2], expected_draw[2])


def test_numpy_arrays_in_rng_state_are_encoded_for_weights_only():
    ckpt = build_checkpoint(step=0, next_step=1, model=_model(), rng={"np": np.random.get_state()})
    loaded = deserialize_checkpoint(serialize_checkpoint(ckpt), "mem")
    original = np.random.get_state()
    assert loaded["rng"]["np"][0] == original[0]
    assert np.array_equal(loaded["rng"]["np"][1], original[1])
    assert loaded["rng"]["np"][1].dtype == original[1].dtype


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_payload_with_pickled_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    payload = {
        "version": 1,
        "step": 0,
        "next_step": 1,
        "model": {},
        "metrics": _RunsCode(str(marker)),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with pytest.raises(ValueError, match="evil.pt: not a loadable weights-only checkpoint"):
        deserialize_checkpoint(buffer.getvalue(), "evil.pt")
    assert not marker.exists()


def test_truncated_bytes_are_refused_naming_the_source():
    data = serialize_checkpoint(build_checkpoint(step=0, next_step=1, model=_model()))
    with pytest.raises(ValueError, match="x.pt: not a loadable"):
        deserialize_checkpoint(data[: len(data) // 2], "x.pt")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"version": 2}, "field 'version' is 2"),
        ({"surprise": 1}, r"unknown checkpoint field\(s\) \['surprise'\]"),
        ({"step": -1}, "field 'step' must be a non-negative int"),
        ({"reason": "bored"}, "field 'reason'"),
    ],
)
def test_format_errors_name_the_file_and_field(patch, message):
    ckpt = build_checkpoint(step=0, next_step=1, model=_model())
    ckpt.update(patch)
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    with pytest.raises(ValueError, match=f"c.pt: {message}"):
        deserialize_checkpoint(buffer.getvalue(), "c.pt")


def test_build_checkpoint_enforces_the_cursor_rule():
    with pytest.raises(ValueError, match="must have next_step=6"):
        build_checkpoint(step=5, next_step=5, model=_model())
    with pytest.raises(ValueError, match="must have next_step=5"):
        build_checkpoint(step=5, next_step=6, model=_model(), reason="terminal")
    assert (
        build_checkpoint(step=5, next_step=5, model=_model(), reason="evacuation")["next_step"] == 5
    )


def test_resume_cursor_must_match_file_name_and_reason():
    periodic = build_checkpoint(step=4, next_step=5, model=_model())
    check_resume_cursor(periodic, "step000000004.pt")
    with pytest.raises(ValueError, match="file name says 5"):
        check_resume_cursor(periodic, "step000000005.pt")
    periodic["next_step"] = 4
    with pytest.raises(ValueError, match="field 'next_step' is 4; a periodic checkpoint"):
        check_resume_cursor(periodic, "step000000004.pt")
    terminal = build_checkpoint(step=10, next_step=10, model=_model(), reason="terminal")
    check_resume_cursor(terminal, "step000000010.pt")


def test_match_state_dict_adds_and_strips_module_prefix():
    plain = _model()
    wrapped = torch.nn.Module()
    wrapped.module = _model()
    sd = plain.state_dict()
    prefixed = match_state_dict_to_model(wrapped, sd)
    assert all(k.startswith("module.") for k in prefixed)
    wrapped.load_state_dict(prefixed)
    stripped = match_state_dict_to_model(plain, wrapped.state_dict())
    assert set(stripped) == set(sd)
    plain.load_state_dict(stripped)


def test_rng_state_for_rank_uses_per_rank_states():
    ckpt = {"rng": "r0", "rng_per_rank": ["r0", "r1"]}
    assert rng_state_for_rank(ckpt, 1) == "r1"
    assert rng_state_for_rank(ckpt, 2) is None
    assert rng_state_for_rank({"rng": "r0", "rng_per_rank": None}, 1) is None


def test_streamed_serialization_gives_the_same_bytes():
    big = torch.nn.Sequential(_model(), torch.nn.Linear(2, 1024), torch.nn.Linear(1024, 512))
    ckpt = build_checkpoint(step=0, next_step=1, model=big, rng=get_rng_state())  # > 1 MB tensors
    # Copy each chunk as it arrives: views are valid only until the next one is requested.
    assert b"".join(bytes(c) for c in serialize_checkpoint_chunks(ckpt)) == serialize_checkpoint(
        ckpt
    )


def test_abandoned_stream_stops_the_serializer():
    big = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    stream = serialize_checkpoint_chunks(build_checkpoint(step=0, next_step=1, model=big))
    next(stream)
    stream.close()  # what a failed write does; must not hang or leak a blocked thread
    assert not any(t.name == "koochak-serialize" for t in threading.enumerate())

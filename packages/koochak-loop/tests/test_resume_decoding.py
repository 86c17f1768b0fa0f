"""A published candidate whose payload does not decode is skipped with a reason, never a crash.

The manifest and SHA256 of every candidate here are valid (the bytes are exactly what was
published); only the payload inside is malformed, as a buggy writer or a hostile file would make it.
"""

from __future__ import annotations

import io
import logging
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from koochak.loop.checkpoint import (
    build_checkpoint,
    checkpoint_store,
    deserialize_checkpoint,
    load,
    publish,
    resolve_auto_resume,
    rng_state_for_rank,
    save,
)
from koochak.loop.seed import get_rng_state, set_rng_state

TAG = "__koochak_ndarray__"


def _valid(step: int) -> dict:
    torch.manual_seed(step)
    return build_checkpoint(
        step=step,
        next_step=step + 1,
        model=torch.nn.Linear(2, 1),
        rng=get_rng_state(),
        metrics={"loss": 0.5},
    )


def _publish_raw(location, step: int, ckpt: dict) -> str:
    """torch.save ``ckpt`` as is (no format check on the way out) and publish it properly."""
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    name = f"step{step:09d}.pt"
    publish(checkpoint_store(location), name, buffer.getvalue())
    return name


def _with(step: int, /, **fields) -> dict:
    ckpt = _valid(step)
    ckpt.update(fields)
    return ckpt


def _rng_with_numpy_key(key) -> dict:
    rng = get_rng_state()
    rng["numpy"] = {**rng["numpy"], "key": key}
    return rng


MALFORMED = {
    # The defect as reported: an array record whose shape is not a tuple of ints.
    "array-shape-str": {"rng": {**get_rng_state(), "python": (TAG, "<u4", "ab", b"\0" * 8)}},
    "array-shape-of-strs": {"rng_per_rank": [(TAG, "<u4", ["a"], b"\0" * 8)]},
    "array-dtype-unknown": {"rng": {"numpy": (TAG, "zz", [2], b"\0" * 8)}},
    "array-dtype-int": {"rng": {"numpy": (TAG, 5, [2], b"\0" * 8)}},
    "array-data-str": {"rng": {"numpy": (TAG, "<u4", [2], "x")}},
    "array-size-mismatch": {"rng": {"numpy": (TAG, "<u4", [3], b"\0" * 8)}},
    "array-object-dtype": {"rng": {"numpy": (TAG, "|O", [1], b"\0" * 8)}},
    "version-tensor": {"version": torch.tensor([1, 1])},
    "version-true": {"version": True},
    "version-float": {"version": 1.0},
    "step-tensor": {"step": torch.tensor(3)},
    "reason-list": {"reason": ["periodic"]},
    "model-list": {"model": [1, 2]},
    "model-int-keys": {"model": {0: torch.zeros(1)}},
    "optimizer-str": {"optimizer": "adam"},
    "optimizer-empty": {"optimizer": {}},
    "optimizer-groups-not-a-list": {"optimizer": {"state": {}, "param_groups": {"lr": 1}}},
    "metrics-list": {"metrics": [1]},
    "metric-tensor": {"metrics": {"loss": torch.zeros(3)}},
    "rng-per-rank-int": {"rng_per_rank": 5},
    "world-size-zero": {"world_size": 0},
    "wall-time-str": {"wall_time": "noon"},
    "rng-not-a-state": {"rng": {"np": 1}},
    "rng-python-garbage": {"rng": {**get_rng_state(), "python": (3, (1, 2), None)}},
    "rng-numpy-key-str": {"rng": _rng_with_numpy_key(torch.zeros(3, dtype=torch.float32))},
    "rng-torch-float": {"rng": {**get_rng_state(), "torch": torch.zeros(4)}},
    "rng-torch-short": {"rng": {**get_rng_state(), "torch": torch.zeros(4, dtype=torch.uint8)}},
    "rng-per-rank-garbage": {"rng_per_rank": [get_rng_state(), {"version": 1}]},
}


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_payload_is_skipped_with_a_reason_naming_the_file(tmp_path, caplog, fields):
    save(_valid(0), tmp_path)
    name = _publish_raw(tmp_path, 1, _with(1, **fields))
    with caplog.at_level(logging.WARNING):
        found = resolve_auto_resume(tmp_path)
    assert found is not None
    path, ckpt = found
    assert ckpt["step"] == 0 and path.endswith("step000000000.pt")
    assert name in caplog.text and "skipping" in caplog.text


def test_the_valid_candidate_still_restores(tmp_path):
    expected = _valid(2)
    save(expected, tmp_path)
    _, ckpt = resolve_auto_resume(tmp_path)
    set_rng_state(rng_state_for_rank(ckpt, 0))  # what the loop does right before the next step
    assert torch.equal(ckpt["model"]["weight"], expected["model"]["weight"])


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=MALFORMED.keys())
def test_every_decode_failure_is_a_value_error_naming_the_file(fields):
    buffer = io.BytesIO()
    torch.save(_with(1, **fields), buffer)
    source = "somewhere/step000000001.pt"
    try:
        ckpt = deserialize_checkpoint(buffer.getvalue(), source)
    except ValueError as exc:
        assert str(exc).startswith(source)
    else:  # decodes; then the resume check (RNG states) must refuse it
        assert "rng" in fields or "rng_per_rank" in fields
        from koochak.loop.checkpoint.format import check_rng_fields

        with pytest.raises(ValueError, match=source):
            check_rng_fields(ckpt, source)


def test_load_names_the_file_for_a_malformed_array(tmp_path):
    path = tmp_path / "step000000001.pt"
    torch.save(_with(1, rng={"numpy": (TAG, "<u4", "ab", b"\0")}), path)
    with pytest.raises(ValueError, match=r"step000000001\.pt: field 'rng' does not decode"):
        load(path)


# ----------------------------------------------------------------------------- fuzzing

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.sampled_from([TAG, "<u4", "|O", "zz", "<f8"]),
    st.builds(torch.zeros, st.integers(0, 4)),
    st.builds(lambda n: torch.zeros(n, dtype=torch.uint8), st.integers(0, 4)),
)
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, min_size=4, max_size=4).map(tuple),
        st.tuples(st.just(TAG), inner, inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(0, 3)), inner, max_size=4),
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "version",
        "step",
        "next_step",
        "reason",
        "model",
        "optimizer",
        "scheduler",
        "scaler",
        "ema",
        "config",
        "rng",
        "rng_per_rank",
        "world_size",
        "wall_time",
        "metrics",
    ]
)
_fuzz = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _resume_never_crashes(ckpt: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        save(_valid(0), root)
        _publish_raw(root, 1, ckpt)
        path, chosen = resolve_auto_resume(root)  # raises nothing; there is always step 0
        assert chosen["step"] in (0, 1)
        if chosen["step"] == 1:  # accepted: then the loop's resume steps must work too
            state = rng_state_for_rank(chosen, 0)
            if state is not None:
                set_rng_state(state)


@_fuzz
@given(field=_fields, value=_values)
def test_fuzzed_field_values_never_crash_resume(field, value):
    ckpt = _valid(1)
    ckpt[field] = value
    _resume_never_crashes(ckpt)


@_fuzz
@given(part=st.sampled_from(["python", "numpy", "torch", "cuda", "version"]), value=_values)
def test_fuzzed_rng_parts_never_crash_resume(part, value):
    rng = get_rng_state()
    rng[part] = value
    _resume_never_crashes(_with(1, rng=rng))


@_fuzz
@given(data=st.data())
def test_fuzzed_payload_bytes_never_crash_resume(data):
    buffer = io.BytesIO()
    torch.save(_valid(1), buffer)
    payload = bytearray(buffer.getvalue())
    for _ in range(data.draw(st.integers(1, 8))):
        index = data.draw(st.integers(0, len(payload) - 1))
        payload[index] = data.draw(st.integers(0, 255))
    with tempfile.TemporaryDirectory() as root:
        save(_valid(0), root)
        publish(checkpoint_store(root), "step000000001.pt", bytes(payload))
        _, chosen = resolve_auto_resume(root)
        assert chosen["step"] in (0, 1)


def test_numpy_arrays_still_round_trip():
    ckpt = build_checkpoint(
        step=0, next_step=1, model=torch.nn.Linear(1, 1), rng={"a": np.arange(6).reshape(2, 3)}
    )
    buffer = io.BytesIO()
    torch.save({**ckpt, "rng": {"a": (TAG, "<i8", [2, 3], np.arange(6).tobytes())}}, buffer)
    loaded = deserialize_checkpoint(buffer.getvalue(), "mem")
    assert np.array_equal(loaded["rng"]["a"], np.arange(6).reshape(2, 3))

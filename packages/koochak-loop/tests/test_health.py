"""GPU health decisions from injected readings (no GPU needed) and the watchdog's summaries."""

from __future__ import annotations

import json

import pytest
import torch
from koochak.loop.health import (
    GPU_HEALTH_EXIT_CODE,
    GpuHealthWatchdog,
    GpuReading,
    GpuUnhealthy,
    HealthPolicy,
    assess_gpu_health,
    health_policy,
    make_gpu_health,
    read_gpu_health,
    under_scruffy,
)

GOOD = GpuReading(device="cuda:0", kernel_ok=True, kernel_seconds=0.001, temperature_c=60.0,
                  ecc_uncorrected=2)


def test_a_good_reading_is_healthy():
    verdict = assess_gpu_health(GOOD, HealthPolicy(), baseline=GOOD)
    assert verdict.healthy and verdict.reasons == ()


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"kernel_ok": False, "kernel_error": "CUDA error: an illegal memory access"}, "illegal memory"),
        ({"kernel_seconds": 30.0}, "took 30.00s"),
        ({"temperature_c": 97.0}, "temperature 97C"),
        ({"ecc_uncorrected": 3}, "1 new uncorrectable ECC"),
    ],
)
def test_each_bad_reading_is_unhealthy_with_a_reason(changes, reason):
    reading = GpuReading(**{**GOOD.__dict__, **changes})
    verdict = assess_gpu_health(reading, HealthPolicy(), baseline=GOOD)
    assert not verdict.healthy
    assert any(reason in r for r in verdict.reasons), verdict.reasons


def test_missing_readings_do_not_count_against_the_device():
    verdict = assess_gpu_health(GpuReading(device="cuda:0", kernel_ok=True))
    assert verdict.healthy


def test_watchdog_records_summaries_and_flags_scruffy(tmp_path):
    readings = iter([GOOD, GpuReading(**{**GOOD.__dict__, "temperature_c": 99.0})])
    dog = GpuHealthWatchdog(
        2, "cpu", out_dir=tmp_path, reader=lambda device: next(readings),
        env={"SCRUFFY_JOB_ID": "j1", "SCRUFFY_ROOT": "/q"},
    )
    assert not dog.due(0) and dog.due(1)
    assert dog.check(1).healthy
    bad = dog.check(3)
    assert not bad.healthy
    lines = [json.loads(x) for x in (tmp_path / "gpu_health.jsonl").read_text().splitlines()]
    assert [x["healthy"] for x in lines] == [True, False]
    assert lines[1]["version"] == 1 and lines[1]["under_scruffy"] is True
    assert lines[1]["action"] == f"checkpoint+exit {GPU_HEALTH_EXIT_CODE}"
    assert lines[1]["reading"]["temperature_c"] == 99.0


def test_watchdog_is_opt_in_and_cuda_only(tmp_path):
    assert make_gpu_health({}, torch.device("cuda", 0), tmp_path) is None
    assert make_gpu_health({"gpu_health_every": 10}, torch.device("cpu"), tmp_path) is None
    made = make_gpu_health({"gpu_health_every": 10}, torch.device("cuda", 0), tmp_path)
    assert made is not None and made.every == 10
    with pytest.raises(ValueError, match="train.gpu_health_every"):
        GpuHealthWatchdog(0, "cpu")


def test_config_keys_reach_the_watchdog_and_its_decisions(tmp_path):
    import dataclasses

    from koochak.loop.config import ConfigError, load_config, resolve_train_config

    cfg = load_config(None, ["train.gpu_health_every=5", "train.gpu_health_max_temperature_c=80",
                             "train.gpu_health_max_new_ecc_uncorrected=1"])  # fmt: skip
    train = dataclasses.asdict(resolve_train_config(cfg.train))
    dog = make_gpu_health(train, torch.device("cuda", 0), tmp_path)
    assert dog is not None and dog.every == 5
    assert dog.policy == HealthPolicy(max_temperature_c=80.0, max_kernel_seconds=10.0,
                                      max_new_ecc_uncorrected=1)  # fmt: skip
    # Injected readings: 85C passes the default limit but not the configured one; one new ECC
    # error is tolerated, two are not.
    readings = iter([GOOD, GpuReading(**{**GOOD.__dict__, "ecc_uncorrected": 3}),
                     GpuReading(**{**GOOD.__dict__, "temperature_c": 85.0}),
                     GpuReading(**{**GOOD.__dict__, "ecc_uncorrected": 4})])  # fmt: skip
    dog.reader = lambda device: next(readings)
    assert [dog.check(s).healthy for s in (4, 9, 14, 19)] == [True, True, False, False]
    assert health_policy({}) == HealthPolicy()
    with pytest.raises(ConfigError, match="train.gpu_health_max_temperature_c"):
        load_config(None, ["train.gpu_health_max_temperature_c=0"])
    with pytest.raises(ConfigError, match="train.gpu_health_every"):
        load_config(None, ["train.gpu_health_every=-1"])


def test_under_scruffy_needs_both_variables():
    assert under_scruffy({"SCRUFFY_JOB_ID": "1", "SCRUFFY_ROOT": "/r"})
    assert not under_scruffy({"SCRUFFY_JOB_ID": "1"})


def test_known_answer_kernel_runs_on_cpu():
    reading = read_gpu_health(torch.device("cpu"))
    assert reading.kernel_ok, reading.kernel_error


def test_exit_code_is_distinct():
    exc = GpuUnhealthy(step=3, verdict=assess_gpu_health(GOOD), path=None)
    assert exc.code == GPU_HEALTH_EXIT_CODE not in (0, 1, 75, 76)

import math

import pytest
from koochak.loop.stats import EMA, SmoothedMeter, Throughput


def test_smoothed_meter_window_and_global_average():
    meter = SmoothedMeter(window=3)
    assert math.isnan(meter.avg) and math.isnan(meter.global_avg)
    for value, n in [(1.0, 1), (2.0, 1), (3.0, 2), (10.0, 4)]:
        meter.update(value, n)
    assert meter.avg == pytest.approx((2 + 3 + 10) / 3)
    assert meter.median == 3.0
    assert meter.value == 10.0
    assert meter.count == 8
    assert meter.global_avg == pytest.approx((1 + 2 + 3 * 2 + 10 * 4) / 8)
    meter.reset()
    assert meter.count == 0 and math.isnan(meter.avg)


def test_smoothed_meter_rejects_bad_window():
    with pytest.raises(ValueError, match="window"):
        SmoothedMeter(window=0)


def test_throughput_uses_the_injected_clock():
    now = [100.0]
    tput = Throughput(clock=lambda: now[0])
    tput.update(32)
    tput.update(32)
    now[0] = 102.0
    assert tput.rate == pytest.approx(32.0)
    assert tput.reset() == pytest.approx(32.0)
    assert tput.items == 0 and math.isnan(tput.rate)


def test_ema_equals_hand_computed_bias_corrected_average():
    ema = EMA(decay=0.5)
    values = [4.0, 2.0, 8.0]
    biased = 0.0
    for t, value in enumerate(values, start=1):
        biased = 0.5 * biased + 0.5 * value
        assert ema.update(value) == pytest.approx(biased / (1 - 0.5**t))
    assert EMA(0.9).update(3.0) == pytest.approx(3.0)  # first value is not pulled to zero


def test_ema_state_round_trip_and_validation():
    ema = EMA(0.8)
    ema.update(1.0)
    ema.update(2.0)
    clone = EMA()
    clone.load_state_dict(ema.state_dict())
    assert clone.value == ema.value
    assert clone.update(5.0) == ema.update(5.0)
    with pytest.raises(ValueError, match="decay"):
        EMA(1.0)
    with pytest.raises(ValueError, match="NaN"):
        ema.update(float("nan"))

import pytest
from koochak.loop.timeit import Timer, time_block


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_measures_with_injected_clock():
    clock = _Clock()
    timer = Timer(clock=clock)
    with timer:
        assert timer.running
        clock.now = 1.5
    assert not timer.running
    assert timer.elapsed == 1.5
    with pytest.raises(RuntimeError, match="before Timer.start"):
        timer.stop()


def test_time_block_accumulates_into_mapping_and_calls_callables():
    totals: dict[str, float] = {}
    for _ in range(2):
        with time_block("data", totals) as timer:
            pass
        assert timer.elapsed >= 0.0
    assert set(totals) == {"data"} and totals["data"] >= 0.0

    seen = []
    with time_block("step", lambda name, seconds: seen.append((name, seconds))):
        pass
    assert [name for name, _ in seen] == ["step"]


def test_time_block_reports_even_when_the_body_raises():
    totals: dict[str, float] = {}
    with pytest.raises(KeyError), time_block("fails", totals):
        raise KeyError("boom")
    assert "fails" in totals


def test_time_block_rejects_bad_arguments():
    with pytest.raises(ValueError, match="name"), time_block(""):
        pass
    with pytest.raises(TypeError, match="sink"), time_block("x", sink=3):  # type: ignore[arg-type]
        pass


def test_cuda_sync_is_harmless_without_cuda():
    with time_block("x", cuda_sync=True) as timer:
        pass
    assert timer.elapsed >= 0.0

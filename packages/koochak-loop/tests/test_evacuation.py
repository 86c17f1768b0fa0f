"""The evacuation controller: the signal handler only records, the decision is reconciled."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from koochak.loop.evacuation import (
    EVACUATION_EXIT_CODE,
    Evacuated,
    EvacuationController,
    make_evacuation,
)


def test_sigusr1_only_records_a_request():
    controller = EvacuationController()
    previous = signal.getsignal(signal.SIGUSR1)
    controller.install()
    try:
        assert not controller.should_evacuate()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert controller.requested
        assert controller.should_evacuate()
    finally:
        controller.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_other_signal_by_name_and_programmatic_request():
    controller = EvacuationController(signal="SIGUSR2")
    assert controller.signum == signal.SIGUSR2
    controller.request()
    assert controller.should_evacuate()


def test_unknown_signal_names_the_key():
    with pytest.raises(ValueError, match="train.evacuation_signal: unknown signal 'NOPE'"):
        EvacuationController(signal="NOPE")


def test_install_off_the_main_thread_is_refused():
    controller = EvacuationController()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            controller.install()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


def test_make_evacuation_prefers_the_argument_then_the_config():
    mine = EvacuationController()
    assert make_evacuation(mine, {"evacuation_enabled": False}) is mine
    assert make_evacuation(None, {"evacuation_enabled": False}) is None
    assert make_evacuation(False, {"evacuation_enabled": True}) is None
    made = make_evacuation(None, {"evacuation_enabled": True, "evacuation_signal": "USR2"})
    assert made is not None and made.signum == signal.SIGUSR2
    assert make_evacuation(True, {}).signum == signal.SIGUSR1


def test_evacuated_exits_with_code_75():
    exc = Evacuated(step=5, checkpoint={"step": 5}, path="/x/step000000005.pt")
    assert isinstance(exc, SystemExit)
    assert exc.code == EVACUATION_EXIT_CODE == 75

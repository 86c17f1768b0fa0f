"""Hook composition: merge/add/emit equal calling each hook by hand; failure policy."""

from __future__ import annotations

import warnings

import pytest
from koochak.loop.hooks import EVENTS, add, emit, fail_closed, is_fail_closed, merge, rank0_only


def recorder(log, tag):
    return lambda info: log.append((tag, info["step"]))


def test_merge_equals_calling_each_hook_by_hand():
    composed, by_hand = [], []
    a = {"on_log": [recorder(composed, "a1"), recorder(composed, "a2")]}
    b = {"on_log": [recorder(composed, "b")], "on_train_end": [recorder(composed, "end")]}
    merged = merge(a, None, b)
    for step in range(3):
        emit(merged, "on_log", {"step": step})
    emit(merged, "on_train_end", {"step": 3})
    for step in range(3):
        for tag in ("a1", "a2", "b"):
            by_hand.append((tag, step))
    by_hand.append(("end", 3))
    assert composed == by_hand
    # merge copies: the inputs are untouched
    assert len(a["on_log"]) == 2 and len(b["on_log"]) == 1


def test_add_appends_in_place_and_chains():
    log = []
    hooks = add(add({}, "on_log", recorder(log, "x")), "on_log", recorder(log, "y"))
    emit(hooks, "on_log", {"step": 7})
    assert log == [("x", 7), ("y", 7)]


def test_unknown_event_names_the_event_and_suggests():
    with pytest.raises(ValueError, match="'on_logg'.*did you mean 'on_log'"):
        merge({"on_logg": []})
    with pytest.raises(ValueError, match="on_start"):
        add({}, "on_start", lambda info: None)
    with pytest.raises(TypeError, match="list of callables"):
        merge({"on_log": lambda info: None})


def test_failing_hook_warns_and_later_hooks_still_run():
    log = []

    def broken(info):
        raise RuntimeError("boom")

    hooks = {"on_log": [broken, recorder(log, "after")]}
    warned: set[int] = set()
    with pytest.warns(RuntimeWarning, match="boom") as record:
        for step in range(3):
            emit(hooks, "on_log", {"step": step}, warned=warned)
    assert log == [("after", 0), ("after", 1), ("after", 2)]
    assert len(record) == 1  # once per hook with a warned set


def test_on_train_start_failure_and_fail_closed_hooks_raise():
    def broken(info):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        emit({"on_train_start": [broken]}, "on_train_start", {"step": 0})
    marked = fail_closed(broken)
    assert is_fail_closed(marked) and not is_fail_closed(broken)
    with pytest.raises(RuntimeError):
        emit({"on_checkpoint": [marked]}, "on_checkpoint", {"step": 0})
    # rank0_only keeps the fail-closed mark
    assert is_fail_closed(rank0_only(marked))


def test_rank0_only_runs_without_a_process_group():
    log = []
    emit({"on_log": [rank0_only(recorder(log, "r0"))]}, "on_log", {"step": 1})
    assert log == [("r0", 1)]


def test_emit_with_no_hooks_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emit(None, "on_log", {"step": 0})
        emit({}, "on_log", {"step": 0})
    assert "on_exception" in EVENTS


def test_stop_training_is_raised_after_the_events_other_hooks_ran(recwarn):
    from koochak.loop.hooks import StopTraining

    seen = []

    def early_stop(info):
        raise StopTraining("eval_loss did not improve for 3 evaluations")

    def budget(info):
        raise StopTraining("budget")

    hooks = {"on_eval_end": [early_stop, lambda info: seen.append(info["step"]), budget]}
    with pytest.raises(StopTraining) as caught:
        emit(hooks, "on_eval_end", {"step": 9}, warned=set())
    assert caught.value.reason == "eval_loss did not improve for 3 evaluations"  # the first
    assert seen == [9] and not recwarn.list  # a request, not a failure: no warning

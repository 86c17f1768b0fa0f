"""The stub's ``workload`` projection pinned to the contract file's section 6: ``workload.phase``
sets ``phase = data.phase`` and ``status = data.status``, progress sets ``status = "active"``,
and a late, older report never regresses the view. In-process, no controller."""

from __future__ import annotations

import importlib

import pytest
import stub_harness

# Quoted from the contract file, section 6 ("Projection `job["workload"]`").
QUOTED = (
    "`workload.phase` sets `phase = data.phase` and `status = data.status`.",
    "`workload.progress` stores the whole `data` as `progress`, sets `phase` from `data.phase` "
    'if it is a str, and sets `status = "active"`.',
    "A newer report wins by the `(occurred_at, event_id)` order, so a late, older report does "
    "not regress the view.",
)


def test_the_quoted_rules_are_the_contract_files():
    found = [p for p in stub_harness.CONTRACT_CANDIDATES if p.is_file()]
    if not found:
        pytest.skip("shared/contracts/scruffy-client-v1.md is not next to this checkout")
    text = " ".join(found[0].read_text(encoding="utf-8").split())
    for quote in QUOTED:
        assert quote in text, quote


@pytest.fixture
def project(scruffy):
    projection = importlib.import_module("scruffy.projection")
    view = projection.empty_workload()

    def apply(kind, data, at, event_id):
        envelope = {"kind": kind, "data": data, "occurred_at": at, "event_id": event_id}
        projection.project(view, envelope, {"recorded_at": at})
        return view

    return apply


def test_a_phase_report_sets_phase_and_status_from_its_data(project):
    view = project("workload.phase", {"phase": "training", "status": "started"}, T(1), "a")
    assert (view["phase"], view["status"]) == ("training", "started")
    assert (view["phase_at"], view["phase_event_id"]) == (T(1), "a")
    view = project("workload.progress", {"completed_steps": 3}, T(2), "b")
    assert (view["phase"], view["status"]) == ("training", "active")
    assert view["progress"] == {"completed_steps": 3}
    view = project("workload.phase", {"phase": "training", "status": "completed"}, T(3), "c")
    assert (view["phase"], view["status"]) == ("training", "completed")
    # Without a status (what Koochak sent before it followed the hook table): null, as on Scruffy.
    view = project("workload.phase", {"phase": "finished"}, T(4), "d")
    assert (view["phase"], view["status"]) == ("finished", None)


def test_a_late_older_report_does_not_regress_the_status(project):
    project("workload.phase", {"phase": "training", "status": "started"}, T(1), "a")
    project("workload.phase", {"phase": "training", "status": "completed"}, T(5), "c")
    # The last progress report, processed after the run's end (another tick, another order).
    view = project("workload.progress", {"phase": "training", "completed_steps": 9}, T(4), "b")
    assert (view["phase"], view["status"]) == ("training", "completed")
    assert view["progress"] == {"phase": "training", "completed_steps": 9}  # its own field moves
    view = project("workload.phase", {"phase": "training", "status": "started"}, T(2), "z")
    assert view["status"] == "completed" and view["phase_event_id"] == "c"


def test_order_is_by_time_then_event_id_whatever_the_utc_offset(project):
    project("workload.phase", {"phase": "training", "status": "failed"}, T(5), "a")
    # 10:00:03+01:00 is 09:00:03Z: older, although it sorts later as text.
    view = project(
        "workload.phase",
        {"phase": "training", "status": "started"},
        "2026-01-01T10:00:03+01:00",
        "b",
    )
    assert view["status"] == "failed"
    view = project("workload.phase", {"phase": "training", "status": "completed"}, T(5), "b")
    assert view["status"] == "completed"  # same instant, larger event id


def T(second: int) -> str:
    return f"2026-01-01T09:00:{second:02d}+00:00"

"""PreparedTask/PreparedWorkflow: exact Scruffy wire dicts, frozen models, and validation
whose errors name the task and the field."""

from __future__ import annotations

import dataclasses

import pytest
from koochak.jobs.workflow import PreparedTask, PreparedWorkflow

RESOURCES = {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1}
RECOVERY = {"max_attempts": 3, "retry_on": ["evacuated", "checkpoint_ack_timeout"],
            "evacuation": {"signal": "USR1", "grace_seconds": 30}}  # fmt: skip
GATE = {"kind": "artifact", "task_id": "train", "artifact_id": "checkpoint/step000000009.pt"}


@dataclasses.dataclass(frozen=True)
class ResourceRequest:  # the shape of scruffy.ResourceRequest
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    memory_gb_per_node: int
    time_limit_seconds: int | None = None


def _provenance(task_id: str) -> dict:
    return {
        "project_id": "proj",
        "workflow_id": "wf-1",
        "task_id": task_id,
        "code_commit": "abc123",
    }


@pytest.fixture
def runs(tmp_path, run_factory, output_factory):
    train = run_factory(tmp_path / "train", "train",
                        outputs=[output_factory("checkpoint/step000000009.pt", _provenance("train"))])  # fmt: skip
    return {"train": train, "infer": run_factory(tmp_path / "infer", "infer")}


def _workflow(runs, **infer):
    tasks = (
        PreparedTask("train", runs["train"], ResourceRequest(1, 0, 1, 1), recovery=RECOVERY),
        PreparedTask(
            "infer", runs["infer"], RESOURCES, **({"needs": [], "wait_for": [GATE]} | infer)
        ),
    )
    return PreparedWorkflow("campaign/attempt-1", "wf-1", "proj", tasks)


def test_wire_dicts_have_exactly_the_allowed_keys(runs):
    train, infer = _workflow(runs).scruffy_tasks()
    assert train == {
        "task_id": "train",
        "request_id": "campaign/attempt-1/train",
        "name": "train",
        "argv": list(runs["train"].runner_argv),
        "cwd": runs["train"].cwd,
        "environment": {},
        "resources": RESOURCES,  # the dataclass, its unset time limit left out
        "needs": [],
        "wait_for": [],
        "recovery": {
            "max_attempts": 3,
            "retry_on": ["evacuated", "checkpoint_ack_timeout"],
            "evacuation": {"signal": "USR1", "grace_seconds": 30},
        },  # fmt: skip
    }
    # Artifact-only release: no needs, one artifact gate; no recovery given, none sent.
    assert (infer["needs"], infer["wait_for"], "recovery" in infer) == ([], [GATE], False)
    assert type(train["argv"]) is list and type(train["recovery"]["retry_on"]) is list
    timed = PreparedTask("t", runs["infer"], ResourceRequest(1, 0, 1, 1, 3600)).to_scruffy_spec("r")
    assert timed["resources"]["time_limit_seconds"] == 3600


def test_needs_and_gates_together_and_the_terminal_condition(runs):
    infer = _workflow(runs, needs=[{"task_id": "train", "condition": "terminal"}]).scruffy_tasks()[
        1
    ]
    assert infer["needs"] == [{"task_id": "train", "condition": "terminal"}]
    assert infer["wait_for"] == [GATE]


def test_models_are_frozen_and_do_not_follow_their_inputs(runs):
    needs = [{"task_id": "train", "condition": "succeeded"}]
    recovery = {**RECOVERY, "retry_on": list(RECOVERY["retry_on"])}
    task = PreparedTask("infer", runs["infer"], dict(RESOURCES), needs=needs, recovery=recovery)
    needs[0]["condition"] = "terminal"
    recovery["retry_on"].append("evacuated")
    spec = task.to_scruffy_spec("r")
    assert spec["needs"][0]["condition"] == "succeeded"
    assert spec["recovery"]["retry_on"] == ["evacuated", "checkpoint_ack_timeout"]
    with pytest.raises(AttributeError):
        task.task_id = "other"
    with pytest.raises(TypeError):
        task.needs[0]["condition"] = "terminal"
    spec["needs"].clear()  # the wire dict is a fresh copy each time
    assert task.to_scruffy_spec("r")["needs"]
    workflow = _workflow(runs)
    with pytest.raises(AttributeError):
        workflow.request_id = "x"
    assert isinstance(workflow.tasks, tuple)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        (
            "needs",
            [{"task_id": "train", "condition": "done"}],
            r"task 'infer': needs\[0\].condition must be 'succeeded' or 'terminal'",
        ),
        (
            "needs",
            [{"task_id": "train"}],
            r"needs\[0\] must have exactly .*missing \['condition'\]",
        ),
        ("needs", [{"task_id": "train", "condition": "succeeded", "x": 1}], r"unexpected \['x'\]"),
        (
            "needs",
            [{"task_id": "train", "condition": "succeeded"}] * 2,
            r"needs\[1\].task_id 'train' appears twice",
        ),
        ("needs", "train", r"task 'infer': needs must be a list"),
        (
            "needs",
            [{"task_id": "bad id", "condition": "succeeded"}],
            r"needs\[0\].task_id must match",
        ),
        ("wait_for", [{**GATE, "kind": "file"}], r"wait_for\[0\].kind must be 'artifact'"),
        (
            "wait_for",
            [{**GATE, "artifact_id": "x" * 257}],
            r"wait_for\[0\].artifact_id must be 1 to 256 printable",
        ),
        ("wait_for", [{**GATE, "artifact_id": "a\nb"}], "256 printable"),
        ("wait_for", [{**GATE, "artifact_id": ""}], "256 printable"),
        (
            "wait_for",
            [GATE, dict(GATE)],
            r"wait_for\[1\] waits for 'train'/'checkpoint/step000000009.pt' twice",
        ),
        ("wait_for", [{"task_id": "train", "artifact_id": "a"}], r"missing \['kind'\]"),
    ],
)
def test_gates_are_validated_naming_task_and_field(runs, field, value, match):
    with pytest.raises(ValueError, match=match):
        PreparedTask("infer", runs["infer"], RESOURCES, **{field: value})


def _recovery(**changes):
    return {**RECOVERY, **changes}


@pytest.mark.parametrize(
    ("recovery", "match"),
    [
        (
            _recovery(max_attempts=0),
            r"task 'train': recovery.max_attempts must be an int from 1 to 10, got 0",
        ),
        (_recovery(max_attempts=11), "from 1 to 10"),
        (_recovery(max_attempts=True), "from 1 to 10, got True"),
        (_recovery(max_attempts=2.0), "from 1 to 10"),
        (_recovery(retry_on=["evacuated", "evacuated"]), r"recovery.retry_on must not repeat"),
        (_recovery(retry_on=["preempted"]), r"recovery.retry_on\[0\] must be one of"),
        (_recovery(retry_on="evacuated"), "recovery.retry_on must be a list"),
        (
            _recovery(evacuation={"signal": "SIGUSR1", "grace_seconds": 5}),
            r"evacuation.signal must be exactly 'USR1'",
        ),
        (
            _recovery(evacuation={"signal": "USR1", "grace_seconds": -1}),
            r"grace_seconds must be an int >= 0, got -1",
        ),
        (
            _recovery(evacuation={"signal": "USR1", "grace_seconds": 0.5}),
            "grace_seconds must be an int",
        ),
        (_recovery(evacuation={"signal": "USR1"}), r"recovery.evacuation must have exactly"),
        (
            {"max_attempts": 2, "retry_on": []},
            r"recovery must have exactly .*missing \['evacuation'\]",
        ),
        ({**RECOVERY, "backoff": 3}, r"unexpected \['backoff'\]"),
        ("3 attempts", "recovery must be a mapping"),
    ],
)
def test_recovery_is_the_exact_v1_mapping(runs, recovery, match):
    with pytest.raises(ValueError, match=match):
        PreparedTask("train", runs["train"], RESOURCES, recovery=recovery)


def test_recovery_edges_that_are_allowed(runs):
    for recovery in (_recovery(retry_on=[]), _recovery(max_attempts=1), _recovery(max_attempts=10),
                     _recovery(evacuation={"signal": "USR1", "grace_seconds": 0})):  # fmt: skip
        spec = PreparedTask("train", runs["train"], RESOURCES, recovery=recovery).to_scruffy_spec(
            "r"
        )
        assert spec["recovery"] == recovery


def test_workflow_references_must_name_its_own_tasks(runs):
    with pytest.raises(
        ValueError, match="task 'infer': wait_for names a task outside this workflow: 'prep'"
    ):
        _workflow(runs, wait_for=[{**GATE, "task_id": "prep"}])
    with pytest.raises(
        ValueError, match="task 'infer': needs names a task outside this workflow: 'prep'"
    ):
        _workflow(runs, needs=[{"task_id": "prep", "condition": "succeeded"}])


def test_workflow_shape_is_validated(runs):
    task = PreparedTask("infer", runs["infer"], RESOURCES)
    with pytest.raises(ValueError, match="must not be empty"):
        PreparedWorkflow("r", "wf-1", "proj", ())
    with pytest.raises(TypeError, match=r"tasks\[0\] must be a PreparedTask, got dict"):
        PreparedWorkflow("r", "wf-1", "proj", [task.to_scruffy_spec("r")])
    with pytest.raises(ValueError, match=r"repeated: \['infer'\]"):
        PreparedWorkflow("r", "wf-1", "proj", [task, task])
    with pytest.raises(ValueError, match="request_id must be a non-blank str"):
        PreparedWorkflow("bad\nid", "wf-1", "proj", [task])
    with pytest.raises(ValueError, match="request_id"):
        PreparedWorkflow("  ", "wf-1", "proj", [task])
    with pytest.raises(ValueError, match="workflow_id must match"):
        PreparedWorkflow("r", "wf 1", "proj", [task])
    with pytest.raises(ValueError, match="project_id must match"):
        PreparedWorkflow("r", "wf-1", "", [task])
    with pytest.raises(ValueError, match="task_id must match"):
        PreparedTask("a:b", runs["infer"], RESOURCES)
    with pytest.raises(ValueError, match="task 'infer': resources must be a mapping"):
        PreparedTask("infer", runs["infer"], 4)


@pytest.mark.parametrize(
    ("provenance", "match"),
    [
        (
            {**_provenance("train"), "task_id": "infer"},
            r"declared output 'checkpoint/step000000009.pt': provenance.task_id must equal 'train', got 'infer'",
        ),
        (
            {**_provenance("train"), "workflow_id": "wf-2"},
            "provenance.workflow_id must equal 'wf-1'",
        ),
        (
            {**_provenance("train"), "project_id": "other"},
            "provenance.project_id must equal 'proj'",
        ),
        (
            {**_provenance("train"), "code_commit": " "},
            "provenance.code_commit must be a non-blank str",
        ),
        (None, "provenance must be a mapping"),
    ],
)
def test_declared_outputs_provenance_must_match_their_task(
    tmp_path, run_factory, output_factory, provenance, match
):
    run = run_factory(tmp_path, outputs=[output_factory("checkpoint/step000000009.pt", provenance)])
    with pytest.raises(ValueError, match=f"task 'train': .*{match}"):
        PreparedWorkflow("r", "wf-1", "proj", [PreparedTask("train", run, RESOURCES)])

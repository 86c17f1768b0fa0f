"""The stub pinned to tests-integration's source of truth, the Scruffy client contract file
(``shared/contracts/scruffy-client-v1.md``): its signatures, validation rules and messages, and
return shapes. In-process, no controller."""

from __future__ import annotations

import ast
import hashlib
import inspect
import math
import re

import pytest
import stub_harness

# Quoted from the contract file (sections 2, 3, 6, 8); test_quotes_are_the_contract_files checks
# them against the file itself wherever it is available.
QUOTED = {
    "submit_job": 'submit_job(root, *, argv: list[str], name: str, cwd: Path, environment: dict[str, str], request: ResourceRequest, request_id: str | None, project_id: str = "default", workflow_id: str | None = None, task_id: str | None = None, needs: Sequence[Mapping] | None = None, wait_for: Sequence[Mapping] | None = None) -> dict',
    "validate_workflow": 'validate_workflow(root, *, request_id: str, workflow_id: str, tasks: Sequence[Mapping], project_id="default") -> dict',
    "submit_workflow": 'submit_workflow(root, *, request_id: str, workflow_id: str, tasks: Sequence[Mapping], project_id="default") -> dict',
    "publish_event": "publish_event(root, *, job_id: str, kind: str, data: dict, event_id: str | None = None, occurred_at: str | None = None, source: dict[str, str] | None = None) -> dict",
    "observe": "observe(root, *, after=None, wait_seconds=0, include_output=False, limit=1000, project_id=None)",
    "status": "status(root, job_id=None, *, project_id=None)",
    "wait_for_job": "wait_for_job(root, job_id, *, timeout=None)",
    "cancel_job": "cancel_job(root, job_id)",
    "ResourceRequest": "ResourceRequest(nodes, gpus_per_node, cpus_per_node, memory_gb_per_node, time_limit_seconds=None)",
}
# What the newer contract adds (contract file, header): wait/timeout and per-task recovery.
NEWER_EXTRA = {"publish_event": {"wait": False, "timeout": None}, "submit_job": {"recovery": None}}


def _shape(text: str) -> list[tuple[str, str, object]]:
    """(name, kind, default) per parameter of a documented call signature."""
    name, _, rest = text.partition("(")
    params = rest[: rest.rindex(")")]
    tree = ast.parse(f"def {name}({params}): pass")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    out: list[tuple[str, str, object]] = []
    pos_defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(args.args, pos_defaults):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "POSITIONAL_OR_KEYWORD", value))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
        out.append((arg.arg, "KEYWORD_ONLY", value))
    return out


def _actual(obj) -> list[tuple[str, str, object]]:
    sig = inspect.signature(obj)
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


def test_the_public_surface_is_the_contracts(scruffy):
    for name in (
        "submit_job",
        "submit_workflow",
        "validate_workflow",
        "publish_event",
        "status",
        "observe",
        "wait_for_job",
        "cancel_job",
        "ResourceRequest",
        "ConflictError",
    ):
        assert hasattr(scruffy, name), name
    assert issubclass(scruffy.ConflictError, RuntimeError)
    assert not issubclass(scruffy.ConflictError, ValueError)


@pytest.mark.parametrize("name", sorted(QUOTED))
def test_signatures_match_the_documented_ones(scruffy, contract, name):
    expected = _shape(QUOTED[name])
    if contract == "newer":
        expected += [(k, "KEYWORD_ONLY", v) for k, v in NEWER_EXTRA.get(name, {}).items()]
    assert _actual(getattr(scruffy, name)) == expected


def test_quotes_are_the_contract_files():
    found = [p for p in stub_harness.CONTRACT_CANDIDATES if p.is_file()]
    if not found:
        pytest.skip("shared/contracts/scruffy-client-v1.md is not next to this checkout")
    text = " ".join(found[0].read_text(encoding="utf-8").split())
    for name, quote in QUOTED.items():
        assert quote in text.replace("( ", "(").replace(" )", ")").replace(", )", ")"), name


def test_the_contract_files_code_blocks_parse_to_the_stubs_signatures(released):
    """Parse every documented signature from the file itself, not from the quotes."""
    found = [p for p in stub_harness.CONTRACT_CANDIDATES if p.is_file()]
    if not found:
        pytest.skip("shared/contracts/scruffy-client-v1.md is not next to this checkout")
    text = " ".join(found[0].read_text(encoding="utf-8").split())
    for name in QUOTED:
        shapes = []
        for match in re.finditer(rf"(?<![A-Za-z_.]){name}\(", text):
            depth = 0
            for end in range(match.start(), len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0 and text[end] == ")":
                    break
            try:
                shapes.append(_shape(text[match.start() : end + 1]))
            except (SyntaxError, ValueError):
                continue  # a call with arguments, not a signature
        assert shapes, name
        # The documented signature is the fullest one the file gives (examples name fewer).
        assert max(shapes, key=len) == _actual(getattr(released, name)), name


# ----------------------------------------------------------------------------- section 2


def test_resource_request_rules(scruffy):
    rr = scruffy.ResourceRequest
    assert [f for f in rr.__dataclass_fields__] == [
        "nodes",
        "gpus_per_node",
        "cpus_per_node",
        "memory_gb_per_node",
        "time_limit_seconds",
    ]
    assert rr(1, 0, 1, 4).to_wire() == {
        "nodes": 1,
        "gpus_per_node": 0,
        "cpus_per_node": 1,
        "memory_gb_per_node": 4,
    }
    for bad in [(0, 0, 1, 1), (1, -1, 1, 1), (True, 0, 1, 1), (1, 0, 1.0, 1), (1, 0, 1, 1, 0)]:
        with pytest.raises(ValueError):
            rr(*bad)
    with pytest.raises(ValueError, match="unexpected"):
        rr.from_wire(
            {
                "nodes": 1,
                "gpus_per_node": 0,
                "cpus_per_node": 1,
                "memory_gb_per_node": 1,
                "partition": "gpu",
            }
        )
    with pytest.raises(AttributeError):
        rr(1, 0, 1, 1).nodes = 2  # frozen


def _job(scruffy, tmp_path, **kw):
    args = dict(
        argv=["/bin/true"],
        name="t",
        cwd=tmp_path,
        environment={},
        request=scruffy.ResourceRequest(1, 0, 1, 1),
        request_id="r-1",
    )
    args.update(kw)
    return scruffy.submit_job(tmp_path / "root", **args)


def test_submit_job_ids_returns_and_idempotency(scruffy, tmp_path):
    first = _job(scruffy, tmp_path)
    assert first == {
        "job_id": "job-" + hashlib.sha256(b"r-1").hexdigest()[:20],
        "project_id": "default",
        "state": "submitted",
        "deduplicated": False,
    }
    assert _job(scruffy, tmp_path)["deduplicated"] is True
    with pytest.raises(scruffy.ConflictError):
        _job(scruffy, tmp_path, argv=["/bin/false"])
    scoped = _job(scruffy, tmp_path, project_id="demo")
    assert scoped["job_id"] == "job-" + hashlib.sha256(b"demo\0r-1").hexdigest()[:20]
    assert re.fullmatch(
        r"job-\d{8}T\d{6}-[0-9a-f]{10}", _job(scruffy, tmp_path, request_id=None)["job_id"]
    )
    spec = stub_harness.read_spec(tmp_path / "root", first["job_id"])
    assert sorted(spec) == sorted(
        ["v", "job_id", "request_id", "name", "submitted_at", "argv", "cwd", "env", "resources"]
    )


def test_submit_job_argument_rules(scruffy, tmp_path):
    with pytest.raises(AttributeError):
        _job(scruffy, tmp_path, cwd=str(tmp_path))  # a str cwd, as 0.1.1 does
    with pytest.raises(ValueError, match="argv"):
        _job(scruffy, tmp_path, argv=["python", ""])
    with pytest.raises(ValueError, match="name"):
        _job(scruffy, tmp_path, name="  ")
    with pytest.raises(ValueError, match="project_id"):
        _job(scruffy, tmp_path, project_id="-bad")
    with pytest.raises(TypeError):
        scruffy.submit_job(
            tmp_path,
            argv=["x"],
            name="n",
            cwd=tmp_path,
            request=scruffy.ResourceRequest(1, 0, 1, 1),
            request_id=None,
        )
    # A consumer attached to an existing workflow may name upstreams not (yet) submitted.
    late = _job(
        scruffy,
        tmp_path,
        request_id="late",
        workflow_id="wf",
        task_id="infer",
        wait_for=[{"kind": "artifact", "task_id": "train", "artifact_id": "a/b"}],
    )
    assert late["state"] == "submitted"


# ----------------------------------------------------------------------------- section 3


_DROP = object()


def _task(tmp_path, task_id, **kw):
    task = {
        "task_id": task_id,
        "argv": ["/bin/true"],
        "cwd": str(tmp_path),
        "resources": {"nodes": 1, "gpus_per_node": 0, "cpus_per_node": 1, "memory_gb_per_node": 1},
    }
    task.update(kw)
    return task


def test_workflow_returns_and_idempotency(scruffy, tmp_path):
    tasks = [
        _task(tmp_path, "train"),
        _task(
            tmp_path,
            "infer",
            needs=[{"task_id": "train", "condition": "succeeded"}],
            wait_for=[
                {
                    "kind": "artifact",
                    "task_id": "train",
                    "artifact_id": "checkpoint/step000000009.pt",
                }
            ],
        ),
    ]
    root = tmp_path / "root"
    valid = scruffy.validate_workflow(root, request_id="wf-1", workflow_id="wf:a", tasks=tasks)
    assert sorted(valid) == sorted(
        ["valid", "submission_id", "project_id", "workflow_id", "identity_sha256", "tasks"]
    )
    assert valid["submission_id"] == "submission-" + hashlib.sha256(b"wf-1").hexdigest()[:20]
    assert valid["tasks"][0]["request_id"] == "wf-1/train"
    assert not root.exists()  # validate writes nothing
    sub = scruffy.submit_workflow(root, request_id="wf-1", workflow_id="wf:a", tasks=tasks)
    assert {k: v for k, v in sub.items() if k not in ("state", "deduplicated")} == {
        k: v for k, v in valid.items() if k != "valid"
    }
    assert (sub["state"], sub["deduplicated"]) == ("submitted", False)
    assert scruffy.submit_workflow(root, request_id="wf-1", workflow_id="wf:a", tasks=tasks)[
        "deduplicated"
    ]
    with pytest.raises(scruffy.ConflictError):
        scruffy.submit_workflow(root, request_id="wf-1", workflow_id="wf:b", tasks=tasks)


@pytest.mark.parametrize(
    ("tasks", "message"),
    [
        ([], "1 to 256"),
        ([{"task_id": "a", "argv": _DROP}], "missing argv"),
        ([{"task_id": "a:b"}], "':'"),
        (
            [{"task_id": "a", "max_attempts": 2}],
            r"tasks\[0\] has unexpected fields: \['max_attempts'\]",
        ),
        ([{"task_id": "a", "cwd": "relative"}], "absolute"),
        (
            [{"task_id": "a", "needs": [{"task_id": "zz", "condition": "succeeded"}]}],
            "workflow dependencies are missing tasks",
        ),
        ([{"task_id": "a", "needs": [{"task_id": "a", "condition": "terminal"}]}], "itself"),
        (
            [{"task_id": "a", "needs": [{"task_id": "b", "condition": "done"}]}, {"task_id": "b"}],
            "condition",
        ),
        (
            [
                {
                    "task_id": "a",
                    "wait_for": [{"kind": "artifact", "task_id": "b", "artifact_id": " x"}],
                },
                {"task_id": "b"},
            ],
            "artifact_id",
        ),
        (
            [
                {"task_id": "a", "needs": [{"task_id": "b", "condition": "terminal"}]},
                {
                    "task_id": "b",
                    "wait_for": [{"kind": "artifact", "task_id": "a", "artifact_id": "x"}],
                },
            ],
            "cycle",
        ),
        ([{"task_id": "a"}, {"task_id": "a"}], "duplicate task_id"),
        ([{"task_id": "a", "environment": {"X": 1}}], "environment"),
    ],
)
def test_workflow_validation_errors(scruffy, tmp_path, tasks, message):
    full = [
        {k: v for k, v in {**_task(tmp_path, t["task_id"]), **t}.items() if v is not _DROP}
        for t in tasks
    ]
    with pytest.raises(ValueError, match=message):
        scruffy.validate_workflow(tmp_path, request_id="r", workflow_id="w", tasks=full)


def test_recovery_exists_only_in_the_newer_contract(scruffy, contract, tmp_path):
    recovery = {
        "max_attempts": 3,
        "retry_on": ["checkpoint_ack_timeout"],
        "evacuation": {"signal": "USR1", "grace_seconds": 30},
    }
    tasks = [_task(tmp_path, "train", recovery=recovery)]
    if contract == "0.1.1":
        with pytest.raises(ValueError, match=r"unexpected fields: \['recovery'\]"):
            scruffy.validate_workflow(tmp_path, request_id="r", workflow_id="w", tasks=tasks)
        return
    assert scruffy.validate_workflow(tmp_path, request_id="r", workflow_id="w", tasks=tasks)[
        "valid"
    ]
    for bad, message in [
        ({"max_attempts": 11}, "1 through 10"),
        ({"max_attempts": True}, "1 through 10"),
        ({"max_attempts": 2, "retry_on": ["signal", "signal"]}, "duplicate-free"),
        ({"max_attempts": 2, "evacuation": {"signal": "TERM", "grace_seconds": 1}}, "USR1"),
        (
            {"max_attempts": 2, "evacuation": {"signal": "USR1", "grace_seconds": -1}},
            "non-negative",
        ),
        ({"max_attempts": 2, "backoff": 1}, "unexpected"),
    ]:
        with pytest.raises(ValueError, match=message):
            scruffy.validate_workflow(
                tmp_path,
                request_id="r",
                workflow_id="w",
                tasks=[_task(tmp_path, "t", recovery=bad)],
            )


# ----------------------------------------------------------------------------- sections 6, 7

PUB = {
    "v": 1,
    "artifact_id": "checkpoint/step000000009.pt",
    "path": "/r/step000000009.pt",
    "size_bytes": 10,
    "sha256": "0" * 64,
    "manifest_path": "/r/step000000009.pt.ready.json",
}


def test_publish_event_returns_spools_and_deduplicates(scruffy, tmp_path):
    root = tmp_path / "root"
    sent = scruffy.publish_event(
        root,
        job_id="job-1",
        kind="workload.artifact",
        data={"publication": PUB},
        event_id="e-1",
        occurred_at="2026-01-01T00:00:00+05:30",
        source={"name": "k"},
    )
    assert sent == {"event_id": "e-1", "job_id": "job-1", "state": "spooled", "deduplicated": False}
    report = root / "reports" / "job-1" / f"{hashlib.sha256(b'e-1').hexdigest()}.json"
    doc = stub_harness.read_report(report)
    assert sorted(doc) == sorted(
        ["v", "event_id", "job_id", "occurred_at", "kind", "source", "data"]
    )
    again = scruffy.publish_event(
        root,
        job_id="job-1",
        kind="workload.artifact",
        data={"publication": PUB},
        event_id="e-1",
        source={"name": "k"},
    )
    assert again["deduplicated"] is True  # a new occurred_at alone still deduplicates
    with pytest.raises(scruffy.ConflictError):
        scruffy.publish_event(
            root,
            job_id="job-1",
            kind="workload.artifact",
            data={"publication": PUB, "step": 9},
            event_id="e-1",
            source={"name": "k"},
        )
    generated = scruffy.publish_event(root, job_id="job-1", kind="workload.notice", data={})
    assert re.fullmatch(r"event-[0-9a-f]{32}", generated["event_id"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "workload.chat"}, "kind"),
        ({"event_id": " e"}, "event_id"),
        ({"event_id": "x" * 257}, "event_id"),
        ({"job_id": "../x"}, "job_id"),
        ({"job_id": ".."}, "job_id"),
        ({"occurred_at": "2026-01-01T00:00:00"}, "offset"),
        ({"occurred_at": "yesterday"}, "occurred_at"),
        ({"source": {"name": " k"}}, "source"),
        ({"source": {f"k{i}": "v" for i in range(33)}}, "source"),
        ({"data": {"x": math.nan}}, "finite"),
        ({"data": {"x": (1, 2)}}, "plain JSON"),
        ({"data": {"x": "\u00e9" * 11_000}}, "65536"),
        ({"data": {"publication": {**PUB, "sha256": "A" * 64}}}, "sha256"),
        ({"data": {"publication": {**PUB, "path": "rel/x"}}}, "absolute"),
        ({"data": {"publication": {**PUB, "size_bytes": 1.0}}}, "size_bytes"),
        ({"data": {"publication": {**PUB, "size_bytes": True}}}, "size_bytes"),
        ({"data": {"publication": {k: v for k, v in PUB.items() if k != "v"}}}, "exactly"),
    ],
)
def test_publish_event_validation_writes_nothing(scruffy, tmp_path, change, message):
    args = dict(job_id="job-1", kind="workload.artifact", data={"publication": PUB}, event_id="e")
    args.update(change)
    with pytest.raises(ValueError, match=message):
        scruffy.publish_event(tmp_path / "root", **args)
    assert not (tmp_path / "root" / "reports").exists()


def test_depth_limit_and_publications_outside_artifacts(scruffy, tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(32):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ValueError, match="deeply"):
        scruffy.publish_event(tmp_path, job_id="j", kind="workload.notice", data=deep)
    # data.publication inside another kind is neither validated nor acted on.
    scruffy.publish_event(
        tmp_path, job_id="j", kind="workload.milestone", data={"publication": {"v": 2}}
    )


def test_newer_publish_event_validates_wait_and_timeout(newer, tmp_path):
    with pytest.raises(ValueError, match="wait"):
        newer.publish_event(tmp_path, job_id="j", kind="workload.notice", data={}, wait="yes")
    with pytest.raises(ValueError, match="timeout"):
        newer.publish_event(
            tmp_path, job_id="j", kind="workload.notice", data={}, wait=True, timeout=-1
        )
    spooled = newer.publish_event(tmp_path, job_id="j", kind="workload.notice", data={})
    assert spooled["state"] == "spooled"


# ----------------------------------------------------------------------------- section 8


def test_status_wait_and_cancel_on_unknown_jobs(scruffy, tmp_path):
    with pytest.raises(KeyError):
        scruffy.status(tmp_path, "job-none")
    with pytest.raises(KeyError):
        scruffy.cancel_job(tmp_path, "job-none")
    with pytest.raises(KeyError):
        scruffy.wait_for_job(tmp_path, "job-none", timeout=5)  # after about 1 s
    submitted = _job(scruffy, tmp_path)
    assert scruffy.status(tmp_path / "root", submitted["job_id"])["state"] == "submitted"
    with pytest.raises(TimeoutError):
        scruffy.wait_for_job(tmp_path / "root", submitted["job_id"], timeout=0.3)


def test_observe_without_after_starts_at_the_tail(scruffy, tmp_path):
    page = scruffy.observe(tmp_path)
    assert sorted(page) == sorted(
        ["snapshot", "events", "next_cursor", "latest_cursor", "more", "reset"]
    )
    assert page["events"] == [] and page["reset"] is False
    with pytest.raises(ValueError, match="cursor"):
        scruffy.observe(tmp_path, after="garbage")
    with pytest.raises(ValueError, match="limit"):
        scruffy.observe(tmp_path, limit=0)

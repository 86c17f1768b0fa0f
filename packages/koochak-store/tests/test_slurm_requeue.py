"""A requeued Slurm job is never locked out by its own dead earlier attempt: lease and intent
records name the holder's Slurm job attempt (koochak.storage._slurm_job), and a record of an
earlier attempt of this very job, or of a job squeue says has ended, is dead. Anything Slurm
cannot prove (same attempt, another job still running, squeue missing or failing) stays alive."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import subprocess
import time

import pytest
from koochak.storage import _publish_intent, _slurm_job
from koochak.storage import lease as leases
from koochak.storage.artifact import publish
from koochak.storage.store import LocalStore

JOB = "4711"
NAME = "step000000007.pt"


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "ckpt")


@pytest.fixture
def attempt(monkeypatch):
    """Run as attempt ``n`` of Slurm job ``job`` on cluster ``c1``."""

    def run_as(job: str = JOB, n: int = 1) -> None:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(n))
        monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")

    return run_as


@pytest.fixture
def squeue(tmp_path, monkeypatch):
    """A stand-in ``squeue`` first on PATH that prints ``out``, ``err`` and exits ``rc``;
    its arguments are logged to ``calls``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "squeue-calls"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def answer(out: str = "", err: str = "", rc: int = 0) -> pathlib.Path:
        script = bin_dir / "squeue"
        script.write_text(
            "#!/bin/sh\n"
            f'echo "$@" >> {calls}\n'
            f"printf '%s' '{out}'\n"
            f"printf '%s' '{err}' >&2\n"
            f"exit {rc}\n"
        )
        script.chmod(0o755)
        return calls

    return answer


def _dead_attempt(job: str = JOB, n: int = 0, cluster: str = "c1") -> leases.LeaseRecord:
    """A lease as a holder on another machine writes it, renewed just now."""
    return leases.LeaseRecord(
        token="e" * 32, host="node-lost", boot_id="their-boot", pid_ns="pid:[1]", pid=4242,
        pid_start=7, started=time.time(), ttl_seconds=600.0, purpose="koochak run in /runs/x",
        machine_id="another-machine", slurm=_slurm_job.SlurmJob(job, n, cluster),
    )  # fmt: skip


def _leave(store, record: leases.LeaseRecord) -> None:
    store.root.mkdir(parents=True, exist_ok=True)
    store.put(leases.LEASE_KEY, record.to_bytes())


def test_an_earlier_attempt_of_this_job_is_taken_over_in_one_line(store, attempt, caplog):
    attempt(JOB, 1)
    _leave(store, _dead_attempt(JOB, 0))
    with (
        caplog.at_level(logging.WARNING, logger="koochak.storage.lease"),
        leases.acquire_lease(store) as held,
    ):
        assert held.record.slurm == _slurm_job.SlurmJob(JOB, 1, "c1")
        assert leases.read_lease(store).slurm == held.record.slurm  # the record says so
    lines = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert len(lines) == 1
    assert f"attempt 0 of Slurm job {JOB}, since" in lines[0]
    assert f"Slurm has requeued job {JOB} since (this is attempt 1)" in lines[0]


def test_the_same_attempt_or_a_later_one_is_alive(store, attempt, squeue):
    calls = squeue(out="COMPLETED\n")  # never asked: the job of this very process runs
    for theirs in (1, 2):
        attempt(JOB, 1)
        _leave(store, _dead_attempt(JOB, theirs))
        with pytest.raises(leases.LeaseHeld, match=f"attempt {theirs} of Slurm job {JOB}"):
            leases.acquire_lease(store)
        store.delete(leases.LEASE_KEY)
    assert not calls.exists()


def test_a_holder_seen_running_here_outweighs_any_slurm_evidence(store, attempt, squeue):
    """A straggler of the earlier attempt still running on this machine (requeued onto the same
    node, say) keeps its lease: its running pid is stronger evidence than the requeue."""
    from koochak.storage._publish_intent import _boot_id, _machine_id, _pid_ns, _start_ticks

    squeue(out="CANCELLED\n")
    attempt(JOB, 1)
    straggler = subprocess.Popen(["sleep", "60"])
    try:
        here = dict(host="this-node", machine_id=_machine_id(), boot_id=_boot_id(),
                    pid_ns=_pid_ns(), pid=straggler.pid, pid_start=_start_ticks(straggler.pid))  # fmt: skip
        for slurm in (_slurm_job.SlurmJob(JOB, 0, "c1"), _slurm_job.SlurmJob("99", 0, "c1")):
            _leave(store, dataclasses.replace(_dead_attempt(), slurm=slurm, **here))
            with pytest.raises(leases.LeaseHeld, match=f"pid {straggler.pid}"):
                leases.acquire_lease(store)
            store.delete(leases.LEASE_KEY)
            intent = dataclasses.replace(_publish_intent.ours(NAME), slurm=slurm, **here)
            assert _publish_intent.why_dead(intent) is None
    finally:
        straggler.kill()
        straggler.wait()
    _leave(store, dataclasses.replace(_dead_attempt(), **here))  # once it is gone: taken over
    leases.acquire_lease(store).release()


def test_another_job_is_alive_while_squeue_says_it_runs(store, attempt, squeue):
    attempt("99", 0)
    calls = squeue(out="RUNNING\n")
    _leave(store, _dead_attempt(JOB, 0))
    with pytest.raises(leases.LeaseHeld, match="node-lost"):
        leases.acquire_lease(store)
    assert f"--jobs={JOB}" in calls.read_text()
    squeue(out="COMPLETING\n")  # its processes may still run
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (dict(out="NODE_FAIL\n"), f"its Slurm job {JOB} has ended (NODE_FAIL)"),
        (dict(out="CANCELLED\n"), "has ended (CANCELLED)"),
        (dict(err="slurm_load_jobs error: Invalid job id specified\n", rc=1),
         f"Slurm no longer knows its job {JOB}"),
    ],
)  # fmt: skip
def test_another_job_that_squeue_says_ended_is_taken_over(
    store, attempt, squeue, caplog, answer, why
):
    attempt("99", 0)
    squeue(**answer)
    _leave(store, _dead_attempt(JOB, 0))
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        leases.acquire_lease(store).release()
    assert why in caplog.text


@pytest.mark.parametrize(
    "answer",
    [
        dict(err="slurm_load_jobs error: Unable to contact slurm controller\n", rc=1),
        dict(out=""),  # no answer
        dict(out="garbage\n"),
        dict(out="COMPLETED\nRUNNING\n"),  # an array's tasks, one still running
    ],
)
def test_a_failing_or_unclear_squeue_proves_nothing(store, attempt, squeue, answer):
    attempt("99", 0)
    squeue(**answer)
    _leave(store, _dead_attempt(JOB, 0))
    with pytest.raises(leases.LeaseHeld, match="node-lost"):
        leases.acquire_lease(store)


def test_squeue_is_asked_only_about_slurm_job_ids(squeue):
    calls = squeue(out="COMPLETED\n")
    for odd in ("4711,4712", "--help", "4711 4712", ""):
        assert _slurm_job.squeue_state(odd) is None
    assert not calls.exists()
    assert _slurm_job.squeue_state("4711_3") == "COMPLETED"


def test_no_squeue_or_a_hanging_one_proves_nothing(store, attempt, tmp_path, monkeypatch):
    attempt("99", 0)
    _leave(store, _dead_attempt(JOB, 0))
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)
    hanging = tmp_path / "hanging"
    hanging.mkdir()
    (hanging / "squeue").write_text(f"#!/bin/sh\nexec {shutil.which('sleep')} 30\n")
    (hanging / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(hanging))
    monkeypatch.setattr(_slurm_job, "SQUEUE_TIMEOUT_SECONDS", 0.3)
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)


def test_another_cluster_or_no_slurm_here_proves_nothing(store, attempt, squeue, monkeypatch):
    calls = squeue(out="COMPLETED\n")
    attempt(JOB, 1)
    _leave(store, _dead_attempt(JOB, 0, cluster="c2"))  # job 4711 of another cluster
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)
    store.delete(leases.LEASE_KEY)
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name)
    _leave(store, _dead_attempt(JOB, 0))
    with pytest.raises(leases.LeaseHeld):
        leases.acquire_lease(store)
    assert not calls.exists()


def test_a_requeued_attempt_takes_over_its_dead_attempts_publish_intent(store, attempt, caplog):
    attempt(JOB, 1)
    theirs = dataclasses.replace(_publish_intent.ours(NAME), host="node-lost", pid=1,
                                 machine_id="another-machine", boot_id="their-boot",
                                 slurm=_slurm_job.SlurmJob(JOB, 0, "c1"))  # fmt: skip
    store.put(NAME + _publish_intent.INTENT_SUFFIX, theirs.to_bytes())
    store.put(NAME, b"their partial bytes")
    with caplog.at_level(logging.WARNING):
        publish(store, NAME, b"mine")
    assert store.get(NAME) == b"mine"
    assert f"attempt 0 of Slurm job {JOB} (committing by" in caplog.text
    assert "requeued job 4711 since (this is attempt 1)" in caplog.text
    # the same attempt (another rank of it, say) is alive until its deadline
    store.put(NAME + _publish_intent.INTENT_SUFFIX, dataclasses.replace(
        theirs, key="step000000008.pt", slurm=_slurm_job.SlurmJob(JOB, 1, "c1")).to_bytes())  # fmt: skip
    assert _publish_intent.why_dead(_publish_intent.parse(
        store.get(NAME + _publish_intent.INTENT_SUFFIX), "x")) is None  # fmt: skip


def test_the_records_carry_the_job_only_under_slurm_and_readers_check_it(
    tmp_path, attempt, monkeypatch
):
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(name, raising=False)
    plain = json.loads(_publish_intent.ours(NAME).to_bytes())
    assert not set(plain) & set(_slurm_job.FIELDS)  # outside Slurm: the record as before
    attempt(JOB, 3)
    doc = json.loads(_publish_intent.ours(NAME).to_bytes())
    assert (doc["slurm_job_id"], doc["slurm_restarts"], doc["slurm_cluster"]) == (JOB, 3, "c1")
    record = _dead_attempt()
    assert leases._parse(record.to_bytes(), "x") == record
    lease_doc = json.loads(record.to_bytes())
    bad = [
        ({**lease_doc, "slurm_restarts": -1}, "slurm_restarts"),
        ({**lease_doc, "slurm_job_id": 4711}, "slurm_job_id"),
        ({k: v for k, v in lease_doc.items() if k != "slurm_cluster"}, "slurm_cluster"),
        ({**{k: v for k, v in lease_doc.items() if k != "machine_id"}, "version": 1}, "slurm_"),
    ]
    for broken, field in bad:
        with pytest.raises(ValueError, match=rf"lease-file: .*{field}"):
            leases._parse(json.dumps(broken).encode(), "lease-file")
    for version in (1, 2):  # older intent records never carried the job
        old = {
            k: v
            for k, v in doc.items()
            if k not in ("machine_id", "written", "pid_ns")[: 4 - version]
        }
        with pytest.raises(ValueError, match="intent-file: unknown or missing field 'slurm_"):
            _publish_intent.parse(json.dumps({**old, "version": version}).encode(), "intent-file")


def test_the_running_local_slurm_proves_a_job_over_only_once_it_ended(monkeypatch):
    """The real squeue (tools/local_slurm.sh): a job id it never issued is unknown, a running job
    is alive, the same job once cancelled has ended."""
    conf = "/tmp/koochak-slurm/slurm.conf"
    if shutil.which("sbatch") is None or not os.path.exists(conf):
        pytest.skip("no local Slurm (tools/local_slurm.sh)")
    monkeypatch.setenv("SLURM_CONF", conf)
    if subprocess.run(["squeue", "-h"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("the local Slurm controller does not answer")
    cluster = "koochak-local"
    here = _slurm_job.SlurmJob("987654321", 0, cluster)  # this process: another job
    assert _slurm_job.squeue_state("987654320") == ""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--output=/dev/null", "--wrap", "sleep 120"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    theirs = _slurm_job.SlurmJob(job, 0, cluster)
    try:
        deadline = time.monotonic() + 60
        while _slurm_job.squeue_state(job) == "PENDING" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _slurm_job.squeue_state(job) == "RUNNING"
        assert _slurm_job.why_ended(theirs, here) is None
        assert _slurm_job.why_ended(theirs, _slurm_job.SlurmJob(job, 0, "another")) is None
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while _slurm_job.squeue_state(job) not in _slurm_job.ENDED_STATES:
        assert time.monotonic() < deadline, _slurm_job.squeue_state(job)
        time.sleep(0.2)
    assert _slurm_job.why_ended(theirs, here) == f"its Slurm job {job} has ended (CANCELLED)"

"""One live run per checkpoint location (issue 29, item 7): koochak-train refuses a second run
into the same out_dir with exit 2 naming the holder, and takes over a dead holder's lease."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from koochak.loop import run_lease
from koochak.loop.cli import main
from koochak.storage import lease as leases
from koochak.storage.lease import LEASE_KEY, read_lease
from koochak.storage.store import LocalStore

USER_CODE = """
import os
import threading
import time
import torch
from torch.nn import functional as F


def make_model(cfg):
    if os.environ.get("LEASE_TEST_BUILT"):
        open(os.environ["LEASE_TEST_BUILT"], "w").close()
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def dataset(cfg, start_step=0):
    gen = torch.Generator().manual_seed(int(cfg.train.seed) + start_step)
    while True:
        x = torch.randn(4, 3, generator=gen)
        yield x, x.sum(1, keepdim=True)


def step_fn(model, batch, ctx):
    x, y = batch
    return {"loss": F.mse_loss(model(x), y)}


NOTICED = threading.Event()  # the test sets it once the run's renewer saw the takeover


def taking_over_step(model, batch, ctx):
    # Update 3 of the run: another run takes the lease over, as after a suspension past the
    # bound; the update ends once this run's renewer has noticed.
    if ctx.step == 2 and ctx.rank == 0 and not NOTICED.is_set():
        from koochak.storage.lease import LEASE_KEY, LeaseRecord

        where = os.path.join(os.environ["LEASE_TEST_DIR"], LEASE_KEY)
        with open(where + ".tmp", "wb") as f:  # replaced in one step: never seen missing
            f.write(LeaseRecord(token="e" * 32, host="node-b", boot_id="b", pid_ns="pid:[1]",
                                pid=4242, pid_start=1, started=time.time(), ttl_seconds=600.0,
                                purpose="the run that took over").to_bytes())  # fmt: skip
        os.replace(where + ".tmp", where)
        assert NOTICED.wait(120), "the renewer never noticed"
    return step_fn(model, batch, ctx)


def waiting_step(model, batch, ctx):
    import time

    flag = os.environ["LEASE_TEST_FLAG"]
    open(flag + ".running", "w").close()
    while not os.path.exists(flag):
        time.sleep(0.05)
    return step_fn(model, batch, ctx)
"""

HOLDER = textwrap.dedent(
    """
    import sys, time
    from koochak.storage.lease import acquire_lease
    from koochak.storage.store import LocalStore

    acquire_lease(LocalStore(sys.argv[1]), purpose="the other run")
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def project(tmp_path, monkeypatch):
    name = f"leasepkg_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "cfg.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            train:
              max_steps: 3
              log_every: 1
              device: cpu
              out_dir: {tmp_path / "run"}
              progress_bar: false
            optim:
              optimizer: {{name: sgd, lr: 0.05}}
            entry:
              model: {name}:make_model
              dataset: {name}:dataset
              step: {name}:step_fn
            """
        )
    )
    return tmp_path, name, config


def _hold(run_dir) -> subprocess.Popen:
    os.makedirs(run_dir, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_into_one_out_dir_is_refused_with_exit_2_naming_the_holder(
    project, capsys, monkeypatch
):
    root, _, config = project
    monkeypatch.setenv("LEASE_TEST_BUILT", str(root / "built"))
    holder = _hold(root / "run")
    try:
        assert main(["--config", str(config), "--resume", "none"]) == 2
        assert not (root / "built").exists()  # refused before the model was built
        err = capsys.readouterr().err
        assert f"train.out_dir: {root / 'run'}/{LEASE_KEY}" in err
        assert (
            f"another run holds this location: pid {holder.pid}" in err and "the other run" in err
        )
        assert not (root / "run" / "step000000003.pt").exists()  # refused before any update
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lease_is_taken_over_with_one_line_and_released(project, caplog):
    root, _, config = project
    holder = _hold(root / "run")
    holder.send_signal(signal.SIGKILL)  # kill -9: its lease stays behind
    holder.wait()
    dead = read_lease(LocalStore(root / "run"))
    assert dead is not None and dead.pid == holder.pid
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        assert main(["--config", str(config), "--resume", "none"]) == 0
    lines = [r.getMessage() for r in caplog.records if "taking over the lease" in r.getMessage()]
    assert len(lines) == 1 and f"pid {holder.pid} is no longer running" in lines[0]
    assert torch.load(root / "run" / "step000000003.pt", weights_only=True)["step"] == 3
    assert read_lease(LocalStore(root / "run")) is None  # released at the end
    assert main(["--config", str(config), "--resume", "auto"]) == 0  # the next run may start


@pytest.mark.slow
def test_two_koochak_train_runs_into_one_out_dir(project, tmp_path):
    root, name, config = project
    flag = str(tmp_path / "go")
    env = {**os.environ, "LEASE_TEST_FLAG": flag, "PYTHONPATH": str(root)}
    first = subprocess.Popen(
        [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume", "none",
         f"entry.step={name}:waiting_step"],  # fmt: skip
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(flag + ".running"):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never started training"
            time.sleep(0.1)
        second = subprocess.run(
            [sys.executable, "-m", "koochak.loop.cli", "--config", str(config), "--resume",
             "auto"],  # fmt: skip
            cwd=root, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"another run holds this location: pid {first.pid}" in second.stderr
    finally:
        open(flag, "w").close()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert torch.load(root / "run" / "step000000003.pt", weights_only=True)["step"] == 3
    assert read_lease(LocalStore(root / "run")) is None


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_publish_with_exit_2(
    project, capsys, monkeypatch
):
    """Two writers into one location are what the lease prevents: once the renewer finds the
    lease taken over, the run publishes nothing more and exits 2 naming the new holder."""
    import importlib

    root, name, config = project
    monkeypatch.setattr(leases, "RENEW_SECONDS", 0.05)
    monkeypatch.setenv("LEASE_TEST_DIR", str(root / "run"))
    user = importlib.import_module(name)

    class Noticed(logging.Handler):
        def emit(self, record):
            if "taken over" in record.getMessage():
                user.NOTICED.set()

    handler = Noticed(logging.ERROR)
    logging.getLogger("koochak.storage.lease").addHandler(handler)
    try:
        code = main(["--config", str(config), "--resume", "none", "train.max_steps=6",
                     "train.ckpt_every=2", f"entry.step={name}:taking_over_step"])  # fmt: skip
    finally:
        logging.getLogger("koochak.storage.lease").removeHandler(handler)
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [ln for ln in err.splitlines() if "koochak-train: error:" in ln]
    assert f"{root / 'run'}/{leases.LEASE_KEY}: this run's lease" in line
    assert "pid 4242 on node-b (the run that took over)" in line
    assert "stopped after 4 updates without publishing" in line
    published = sorted(p.name for p in (root / "run").glob("step*.pt"))
    assert published == ["step000000001.pt"]  # the save before the takeover, nothing after
    assert leases.read_lease(LocalStore(root / "run")).host == "node-b"  # left to its holder
    assert run_lease._TAKEN == {}


API_RUN = textwrap.dedent(
    """
    import sys, torch
    from koochak.loop import training_loop
    from koochak.loop.dist import exit_distributed_process

    def data():
        while True:
            yield torch.randn(4, 3)

    try:
        training_loop(model=torch.nn.Linear(3, 1), dataset=data(),
                      step_fn=lambda m, b, ctx: {"loss": m(b).pow(2).mean()},
                      optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                      train_cfg={"max_steps": 2, "device": "cpu", "ddp": True,
                                 "out_dir": sys.argv[1], "progress_bar": False})
        code = 0
    except Exception as exc:
        print(f"api-run: error: {exc}", file=sys.stderr, flush=True)
        code = 2 if "another run holds" in str(exc) else 1
    exit_distributed_process(code)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["koochak-train", "training_loop"])
def test_every_ddp_rank_learns_of_the_refusal_and_exits_2_naming_the_holder(project, route):
    """2 gloo ranks into a held location: rank 0's refusal reaches rank 1 through one broadcast
    at start (before it, rank 1 waited in its first collective for a rank 0 that had left)."""
    root, name, config = project
    holder = _hold(root / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if route == "koochak-train":
        args = ["-m", "koochak.loop.cli", "--config", str(config), "--resume", "none",
                "train.ddp=true"]  # fmt: skip
    else:
        args = ["-c", API_RUN, str(root / "run")]
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(root),
                       LEASE_TEST_BUILT=str(root / f"built{rank}"))  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, *args], cwd=root, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
        results = [(p.communicate(timeout=180), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        holder.kill()
        holder.wait()
    for rank, ((_, err), code) in enumerate(results):
        assert code == 2, f"rank {rank}: {err}"
        assert f"another run holds this location: pid {holder.pid}" in err, f"rank {rank}: {err}"
        assert "the other run" in err
    if route == "koochak-train":  # refused before the model was built, on every rank
        assert not (root / "built0").exists() and not (root / "built1").exists()


TAKEN_OVER_UNDER_DDP = """
import logging, sys
import koochak.storage.lease as leases

leases.RENEW_SECONDS = 0.05
import {name} as user


class Noticed(logging.Handler):
    def emit(self, record):
        if "taken over" in record.getMessage():
            user.NOTICED.set()


logging.getLogger("koochak.storage.lease").addHandler(Noticed(logging.ERROR))
from koochak.loop.cli import main

main(["--config", {config!r}, "--resume", "none", "train.ddp=true", "train.max_steps=6",
      "train.ckpt_every=2", "entry.step={name}:taking_over_step"])
"""


@pytest.mark.slow
def test_under_ddp_a_lost_lease_stops_every_rank_before_the_next_publish(project):
    """Only rank 0 holds the lease: its loss reaches rank 1 at the next publish (one all-reduce
    there), and both ranks exit 2 with the reason, publishing nothing more."""
    root, name, config = project
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = TAKEN_OVER_UNDER_DDP.format(name=name, config=str(config))
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(root),
                       LEASE_TEST_DIR=str(root / "run"))  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env,
                                          text=True, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))  # fmt: skip
        results = [(p.communicate(timeout=240), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, ((_, err), code) in enumerate(results):
        assert code == 2, f"rank {rank}: {err}"
        assert "this run's lease on its checkpoint location is lost" in err, f"rank {rank}: {err}"
        assert "pid 4242 on node-b" in err and "stopped after 4 updates" in err
    assert sorted(p.name for p in (root / "run").glob("step*.pt")) == ["step000000001.pt"]


@pytest.mark.slow
def test_a_live_run_in_another_nodes_first_tier_refuses_every_rank(project):
    """A node-local first tier (``{node}``): the first rank of every node takes the lease on its
    node's directory, so a run still live there (a double submission that landed on node 1)
    refuses the whole launch, exit 2 on every rank, before anything is built (issue 35)."""
    root, name, config = project
    holder = _hold(root / "node1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "koochak.loop.cli", "--config", str(config), "--resume", "auto",
            "train.ddp=true", f"train.checkpoint_dir={root}/node{{node}}",
            f"train.checkpoint_replicas=[{root}/durable]"]  # fmt: skip
    procs = []
    try:
        for rank in (0, 1):  # two nodes of one rank each: each is its node's first rank
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2",
                       KOOCHAK_NODE_INDEX=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONPATH=str(root),
                       LEASE_TEST_BUILT=str(root / f"built{rank}"))  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, *args], cwd=root, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
        results = [(p.communicate(timeout=180), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        holder.kill()
        holder.wait()
    for rank, ((_, err), code) in enumerate(results):
        assert code == 2, f"rank {rank}: {err}"
        assert f"another run holds this location: pid {holder.pid}" in err, f"rank {rank}: {err}"
        assert f"{root / 'node1'}" in err, f"rank {rank}: {err}"
    assert not (root / "built0").exists() and not (root / "built1").exists()
    # What rank 0 took (node 0's tier, the replica, out_dir) was released: nothing left behind.
    assert not (root / "node0").exists() and not (root / "durable").exists()


def _two_nodes(root, config, run) -> list[tuple[str, int]]:
    """koochak-train as two nodes of one rank each (KOOCHAK_NODE_INDEX), first tier
    ``{run}/node{node}``, replica ``{run}/durable``: each rank's (stderr, exit code)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-m", "koochak.loop.cli", "--config", str(config), "--resume", "auto",
            "train.ddp=true", f"train.out_dir={run}/out", f"train.checkpoint_dir={run}/node{{node}}",
            f"train.checkpoint_replicas=[{run}/durable]"]  # fmt: skip
    procs = []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2",
                       KOOCHAK_NODE_INDEX=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), PYTHONPATH=str(root))  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, *args], cwd=root, env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
        return [(p.communicate(timeout=180)[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_every_nodes_first_tier_is_marked_and_another_runs_marker_there_refuses_every_rank(
    project,
):
    """A node-local first tier (``{node}``): node 1's first rank claims its node's tier for the
    run id rank 0 decided, so node 1's tier carries the run's marker too; a tier there that
    another run marked and committed to refuses every rank, naming it, and what the refused start
    took is given back (issue 35's leftover: only rank 0's node was marked)."""
    import shutil

    from koochak.loop.checkpoint.tier_marker import MARKER_KEY, read_marker

    root, _, config = project
    first = root / "first"
    for rank, (err, code) in enumerate(_two_nodes(root, config, first)):
        assert code == 0, f"rank {rank}: {err}"
    node0, node1 = (read_marker(LocalStore(str(first / f"node{i}"))) for i in (0, 1))
    assert node0 is not None and node1 is not None, "node 1's first tier has no tier marker"
    assert node1.run_id == node0.run_id and node1.tier_id != node0.tier_id
    # Another run's place: node 1's tier holds the first run's marker and committed checkpoints.
    other = root / "other"
    shutil.copytree(first / "node0", other / "node1", symlinks=True)
    before = (other / "node1" / MARKER_KEY).read_bytes()
    results = _two_nodes(root, config, other)
    for rank, (err, code) in enumerate(results):
        assert code == 2, f"rank {rank}: {err}"
        assert f"{other / 'node1'}" in err and repr(node0.run_id) in err, f"rank {rank}: {err}"
    assert (other / "node1" / MARKER_KEY).read_bytes() == before  # refused, not taken over
    for where in ("node0", "durable"):  # rank 0's fresh markers went with the refusal
        assert read_marker(LocalStore(str(other / where))) is None, where
    for where in ("node0", "node1", "durable", "out"):
        assert read_lease(LocalStore(str(other / where))) is None, where


def _lost_nodes_lease(where) -> None:
    """The lease attempt 0 of Slurm job 4711 left on ``where`` when its node was lost: written
    as that node wrote it (another machine, another boot), renewed a moment ago."""
    from koochak.storage._slurm_job import SlurmJob

    record = leases.LeaseRecord(
        token=os.urandom(16).hex(), host="node-lost", boot_id="their-boot", pid_ns="pid:[1]",
        pid=4242, pid_start=7, started=time.time(), ttl_seconds=600.0,
        purpose="koochak run on the lost node", machine_id="the-lost-machine",
        slurm=SlurmJob("4711", 0, "koochak-local"),
    )  # fmt: skip
    LocalStore(where).put(LEASE_KEY, record.to_bytes())


def test_a_requeued_slurm_job_takes_over_its_lost_attempts_leases_and_resumes(
    project, monkeypatch, caplog, capsys
):
    """Issue 35 follow-up: the node holding rank 0 is lost, Slurm requeues the job on another
    machine; the dead attempt's leases on the shared replica and out_dir (alive by machine
    evidence for 15 minutes) are taken over at once, one line each, and the run resumes. Another
    job is refused as before."""
    root, _, config = project
    squeue = root / "bin" / "squeue"  # the scheduler says every other job still runs
    squeue.parent.mkdir()
    squeue.write_text("#!/bin/sh\necho RUNNING\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{squeue.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "koochak-local")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    shared = [f"train.checkpoint_replicas=[{root / 'durable'}]"]
    args = ["--config", str(config), "--resume", "auto", *shared]
    assert main([*args, f"train.checkpoint_dir={root / 'lost-node'}"]) == 0
    for where in (root / "durable", root / "run"):  # what the lost node's rank 0 left
        _lost_nodes_lease(where)

    monkeypatch.setenv("SLURM_JOB_ID", "4712")  # another job: refused as before
    assert main([*args, f"train.checkpoint_dir={root / 'new-node'}", "train.max_steps=6"]) == 2
    assert "another run holds this location: pid 4242 on node-lost" in capsys.readouterr().err

    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # Slurm requeued job 4711 on another machine
    with caplog.at_level(logging.WARNING, logger="koochak.storage.lease"):
        assert main([*args, f"train.checkpoint_dir={root / 'new-node'}", "train.max_steps=6"]) == 0
    lines = [r.getMessage() for r in caplog.records if "taking over the lease" in r.getMessage()]
    assert len(lines) == 2, lines  # one line for each place the dead attempt held
    for line in lines:
        assert (
            "attempt 0 of Slurm job 4711, since" in line
            and "Slurm has requeued job 4711 since (this is attempt 1)" in line
        )
    assert {line.split(": taking over")[0] for line in lines} == {
        f"{root / 'durable'}/{LEASE_KEY}",
        f"{root / 'run'}/{LEASE_KEY}",
    }
    err = capsys.readouterr().err  # resumed from the replica at step 3, not started over
    assert f"resuming from {root / 'durable'}/step000000003.pt (tier 1) at step 3 of 6" in err
    assert torch.load(root / "durable" / "step000000006.pt", weights_only=True)["step"] == 6
    for where in (root / "durable", root / "run", root / "new-node"):
        assert read_lease(LocalStore(where)) is None  # released at the end


@pytest.mark.parametrize("fails_in", ["optimizer factory", "state factory"])
def test_a_setup_failure_after_the_claim_gives_the_location_back_at_once(tmp_path, fails_in):
    # Issue 35's leftover: training_loop claimed the location (the lease, renewed on a thread,
    # and the tier marker), then an error while it built the run (here a factory the user
    # passed) left the lease held by this live process, so a second run into the same place
    # was refused until the lease's deadline. The claim goes back with the error.
    from koochak.loop import training_loop
    from koochak.loop.config import ConfigError

    def broken(_):
        raise RuntimeError(f"the {fails_in} failed")

    def run(**broken_part):
        model = torch.nn.Linear(3, 1)
        args = {"optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.1), **broken_part}
        return training_loop(
            model=model, dataset=[(torch.ones(2, 3), torch.ones(2, 1))] * 2,
            step_fn=lambda m, b, ctx: {"loss": torch.nn.functional.mse_loss(m(b[0]), b[1])},
            train_cfg={"max_steps": 2, "device": "cpu", "out_dir": str(tmp_path / "run")},
            resume="auto", **args,
        )  # fmt: skip

    part = {"optimizer": broken} if fails_in == "optimizer factory" else {"state": broken}
    with pytest.raises(RuntimeError, match=f"the {fails_in} failed"):
        run(**part)
    assert read_lease(LocalStore(str(tmp_path / "run"))) is None  # released, not left to run out
    try:
        checkpoint = run()  # the same place again, at once: not "another live run holds it"
    except ConfigError as exc:  # what the old code said
        pytest.fail(f"the failed run kept its claim: {exc}")
    assert checkpoint["next_step"] == 2


@pytest.mark.parametrize("resume", ["auto", "none"])
@pytest.mark.parametrize("run_id", [None, "another-run"])
def test_the_marker_of_a_run_that_aborted_after_its_claim_locks_no_one_out(
    tmp_path, caplog, resume, run_id
):
    # Issue 35's leftover: a training_loop whose setup raised after the claim leaves its tier
    # marker in out_dir (it committed nothing). The next run into the same place, resuming or
    # starting over, as the same run or another one, starts at once, trains and owns the place:
    # the same run keeps its id, another run takes the marker over with one line.
    from koochak.loop import training_loop
    from koochak.loop.checkpoint.tier_marker import read_marker

    def broken(_):
        raise RuntimeError("the optimizer factory failed")

    def run(resume, optimizer, **train):
        return training_loop(
            model=torch.nn.Linear(3, 1), dataset=[(torch.ones(2, 3), torch.ones(2, 1))] * 2,
            step_fn=lambda m, b, ctx: {"loss": torch.nn.functional.mse_loss(m(b[0]), b[1])},
            train_cfg={"max_steps": 2, "device": "cpu", "out_dir": str(tmp_path / "run"), **train},
            resume=resume, optimizer=optimizer,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="the optimizer factory failed"):
        run("auto", broken)
    aborted = read_marker(LocalStore(str(tmp_path / "run")))
    assert aborted is not None  # what the aborted run left: its marker, no checkpoint
    train = {"run_id": run_id} if run_id else {}
    with caplog.at_level(logging.WARNING, logger="koochak.loop.checkpoint"):
        checkpoint = run(resume, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), **train)
    assert checkpoint["next_step"] == 2
    owner = read_marker(LocalStore(str(tmp_path / "run")))
    assert owner is not None and owner.run_id == checkpoint["run_id"]
    assert checkpoint["run_id"] == (run_id or aborted.run_id)  # the same run keeps its id
    took_over = [r for r in caplog.records if "taking over the tier marker" in r.getMessage()]
    assert len(took_over) == (1 if run_id else 0)
    assert not (tmp_path / "run" / "superseded").exists()  # nothing committed: nothing set aside

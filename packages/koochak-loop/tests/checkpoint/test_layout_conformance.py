"""The layout conformance suite (issue 27): every checkpoint layout passes the same behaviours.

Layouts: one file, parts=2, sharded (FSDP2 on 2 gloo ranks); tiers: one, or a replica behind it
(a directory, or the loopback S3 of tools/local_s3.sh); saves sync or async. Behaviours: the
round trip is exact; a damaged or missing object falls back (to the same step in a replica);
kill -9 mid-save selects nothing new; async saves keep their step's values (the first tier's
puts are slowed, so the parameters change while the background writer still reads them);
retention per tier; replication to the second tier; resume from the replica with the first tier
gone; resume on another world size (sharded -> one process).

Each combination trains once (layout_world.py: 4 updates, a save after each); every behaviour
then checks that run's tiers. The sharded runs share one world start (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from koochak.loop.checkpoint import checkpoint_objects, load, resolve_auto_resume
from koochak.loop.checkpoint.format import CHECKPOINT_PATTERN, checkpoint_name
from koochak.loop.checkpoint.restore import restore_training_state
from koochak.storage import artifact
from koochak.storage.store import LocalStore, open_store

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path.insert(0, str(HERE))
import layout_world as world  # noqa: E402

LAYOUTS = ["one file", "parts", "sharded"]
TIERS = ["one tier", "dir replica", "s3 replica"]
MODES = ["sync", "async"]
# Every save of a run: periodic after updates 0, 1, 2; the terminal one after the 4th update.
SAVES = [0, 1, 2, world.STEPS]


def _combos():
    for layout in LAYOUTS:
        for tiers in TIERS:
            for mode in MODES:
                marks = []
                if layout == "sharded":
                    marks.append(pytest.mark.slow)
                yield pytest.param(layout, tiers, mode, marks=marks,
                                   id=f"{layout}-{tiers}-{mode}".replace(" ", "_"))  # fmt: skip


COMBOS = list(_combos())


# ---------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def s3_scheme(request, tmp_path_factory):
    """``ckpts3://`` on the loopback S3 (a stores-file entry with a fresh prefix), or None when
    no test here needs it."""
    local_s3 = request.getfixturevalue("local_s3")
    prefix = f"tests/conformance-{uuid.uuid4().hex}"
    stores = tmp_path_factory.mktemp("stores") / "stores.yaml"
    stores.write_text(
        "version: 1\nstores:\n  ckpts3:\n    backend: s3\n    options: {"
        f"endpoint: '{local_s3.endpoint}', bucket: {local_s3.native_bucket}, "
        f"prefix: '{prefix}', region: us-east-1, path_style: true}}\n"
    )
    saved = {k: os.environ.get(k) for k in [*local_s3.credentials, "KOOCHAK_STORES"]}
    os.environ.update(local_s3.credentials)
    os.environ["KOOCHAK_STORES"] = str(stores)
    yield "ckpts3"
    for run_name in _S3_USED:
        store = open_store(f"ckpts3://{run_name}")
        for info in store.list(""):
            store.delete(info.key)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


_S3_USED: list[str] = []


def _replicas(request, root: Path, tiers: str, run_name: str) -> list[str]:
    if tiers == "one tier":
        return []
    if tiers == "dir replica":
        return [str(root / "replica")]
    scheme = request.getfixturevalue("s3_scheme")
    _S3_USED.append(run_name)
    return [f"{scheme}://{run_name}"]


class Run:
    def __init__(self, first: Path, replicas: list[str], final: dict | None, error: str | None):
        self.first, self.replicas, self.final, self.error = first, replicas, final, error

    def check(self) -> Run:
        assert self.error is None, self.error
        return self


_RUNS: dict[tuple[str, str, str], Run] = {}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.fixture
def trained(request, runs_root):
    """``trained(layout, tiers, mode)``: that combination's Run (trained on first use)."""

    def get(layout: str, tiers: str, mode: str) -> Run:
        key = (layout, tiers, mode)
        if key not in _RUNS:
            if layout == "sharded":
                _sharded_world(request, runs_root)
            else:
                _RUNS[key] = _train_here(request, runs_root, *key)
        return _RUNS[key].check()

    return get


def _run_name(layout, tiers, mode) -> str:
    return f"{layout}-{tiers}-{mode}".replace(" ", "_")


def _train_here(request, root: Path, layout: str, tiers: str, mode: str) -> Run:
    name = _run_name(layout, tiers, mode)
    first = root / name / "first"
    replicas = _replicas(request, root / name, tiers, name)
    result = world.run(str(first), replicas, layout, mode == "async")
    return Run(first, replicas, {"model": result["model"], "optimizer": result["optimizer"],
                                 "step": result["step"]}, None)  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_world(request, root: Path) -> None:
    """Every sharded combination in one world of 2 gloo ranks (started once)."""
    if any(key[0] == "sharded" for key in _RUNS):
        return
    out = root / "sharded-world"
    out.mkdir()
    specs, keys = [], []
    for tiers in TIERS:
        for mode in MODES:
            name = _run_name("sharded", tiers, mode)
            try:
                replicas = _replicas(request, root / name, tiers, name)
            except pytest.skip.Exception:
                continue  # no loopback S3 here
            specs.append({"name": name, "first": str(root / name / "first"),
                          "replicas": replicas, "async": mode == "async"})  # fmt: skip
            keys.append(("sharded", tiers, mode))
    (out / "spec.json").write_text(json.dumps(specs))
    port = _port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "layout_world.py"), str(out), str(out / "spec.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        ))  # fmt: skip
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise AssertionError("the sharded world failed:\n" + "\n".join(logs)[-6000:])
    for spec, key in zip(specs, keys):
        outcomes = [json.loads((out / f"{spec['name']}.{r}.json").read_text()) for r in range(2)]
        errors = [o["error"] for o in outcomes if not o["ok"]]
        final = out / f"{spec['name']}.final.pt"
        _RUNS[key] = Run(Path(spec["first"]), spec["replicas"],
                         torch.load(final, weights_only=True) if final.exists() else None,
                         errors[0] if errors else None)  # fmt: skip


# ---------------------------------------------------------------------------- helpers


def _committed(location) -> list[int]:
    store = open_store(location) if not isinstance(location, Path) else LocalStore(location)
    return sorted(n for n, _ in artifact.published_candidates(store, CHECKPOINT_PATTERN))


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _copy_first(run: Run, dest: Path) -> Path:
    shutil.copytree(run.first, dest, ignore=shutil.ignore_patterns(".*", "*.csv", "*.jsonl"))
    for path in dest.iterdir():
        os.chmod(path, 0o644)
    return dest


# ---------------------------------------------------------------------------- behaviours


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_round_trip_is_exact(trained, layout, tiers, mode):
    run = trained(layout, tiers, mode)
    ckpt = load(run.first / checkpoint_name(world.STEPS))
    _same(ckpt["model"], run.final["model"], "model")
    _same(ckpt["optimizer"], run.final["optimizer"], "optimizer")
    assert ckpt["step"] == run.final["step"] == world.STEPS


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_async_saves_keep_their_steps_values(trained, layout, tiers, mode):
    """Every committed checkpoint of step N holds the values after update N: those of the
    same layout's synchronous one-tier run, although (async, slowed first tier) the updates
    after N changed the parameters in place while it was still being written."""
    run = trained(layout, tiers, mode)
    reference = trained(layout, "one tier", "sync")
    locations = [run.first, *run.replicas]
    for location in locations:
        store = LocalStore(location) if isinstance(location, Path) else open_store(location)
        for step in _committed(location):
            ref_name = reference.first / checkpoint_name(step)
            if not ref_name.exists():  # pruned from the reference's first tier
                continue
            _same(load(store, checkpoint_name(step))["model"], load(ref_name)["model"],
                  f"{location} step {step}")  # fmt: skip


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_retention_keeps_the_last_k_per_tier(trained, layout, tiers, mode):
    run = trained(layout, tiers, mode)
    assert _committed(run.first) == SAVES[-world.KEEP_FIRST :]
    for replica in run.replicas:
        assert _committed(replica) == SAVES[-world.KEEP_REPLICA :]
    # Nothing but the committed checkpoints' objects stays behind in the first tier.
    kept = {key for step in _committed(run.first)
            for key in checkpoint_objects(run.first, checkpoint_name(step))}  # fmt: skip
    present = {p.name for p in run.first.iterdir() if p.name.startswith("step")}
    assert present == kept


@pytest.mark.parametrize("layout, tiers, mode", [c for c in COMBOS if c.values[1] != "one tier"])
def test_replication_commits_the_same_checkpoint_in_the_second_tier(trained, layout, tiers, mode):
    run = trained(layout, tiers, mode)
    first = LocalStore(run.first)
    replica = open_store(run.replicas[0])
    for step in _committed(run.first):
        name = checkpoint_name(step)
        assert artifact.read_manifest(replica, name)[1] == artifact.read_manifest(first, name)[1]
        _same(load(replica, name), load(first, name), name)


@pytest.mark.parametrize("layout, tiers, mode", [c for c in COMBOS if c.values[1] != "one tier"])
def test_resume_from_the_replica_with_the_first_tier_gone(trained, tmp_path, layout, tiers, mode):
    run = trained(layout, tiers, mode)
    gone = tmp_path / "node-local-on-another-node"  # never created: the first tier is gone
    path, ckpt = resolve_auto_resume([str(gone), run.replicas[0]])
    assert ckpt["step"] == world.STEPS and "node-local" not in path
    _same(ckpt["model"], run.final["model"], "model")


def _damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x20
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["damaged", "missing"])
@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_a_damaged_or_missing_object_falls_back(trained, tmp_path, layout, tiers, mode, how):
    """Each object of the newest checkpoint in turn (file; index; every part): one tier falls
    back to the step below; with a replica, to the same step there (never a step back)."""
    run = trained(layout, tiers, mode)
    newest = checkpoint_name(world.STEPS)
    objects = [key for key in checkpoint_objects(run.first, newest)
               if not key.endswith(artifact.READY_SUFFIX)]  # fmt: skip
    for number, key in enumerate(objects):
        copy = _copy_first(run, tmp_path / f"{number}")
        _damage(copy / key, how)
        found = resolve_auto_resume([str(copy), *run.replicas])
        if run.replicas:
            assert found.checkpoint["step"] == world.STEPS, key
            assert not found.path.startswith(str(copy)), key
        else:
            assert found.checkpoint["step"] == SAVES[-2], key
            assert found.path == str(copy / checkpoint_name(SAVES[-2]))


def _wait_for(paths, procs, what) -> None:
    deadline = time.monotonic() + 300
    while not all(p.exists() for p in paths):
        assert all(p.poll() is None for p in procs), f"{what}: a process ended first"
        assert time.monotonic() < deadline, f"{what}: the save never started"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kill_9_mid_save_selects_nothing_new(tmp_path, layout):
    root = tmp_path / "first"
    root.mkdir()
    if layout == "sharded":  # every rank killed inside its part of step 2's save
        port = _port()
        procs = [subprocess.Popen(
            [sys.executable, str(HERE / "layout_world.py"), "--kill-sharded", str(root)],
            env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
            cwd=ROOT, stdout=subprocess.DEVNULL,
        ) for rank in range(2)]  # fmt: skip
        markers = [root / f"READY_TO_KILL.{rank}" for rank in range(2)]
    else:
        procs = [subprocess.Popen([sys.executable, str(HERE / "layout_world.py"), "--kill",
                                   str(root), layout], cwd=ROOT)]  # fmt: skip
        markers = [root / "READY_TO_KILL"]
    before = 1  # committed before the killed save: step 1 (and, sharded, step 0)
    try:
        _wait_for(markers, procs, layout)
    finally:
        for proc in procs:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (root / "step000000002.pt.publishing.json").exists() or layout == "sharded"
    assert not (root / "step000000002.pt.ready.json").exists()
    path, ckpt = resolve_auto_resume(root)
    assert ckpt["step"] == before and path.endswith(checkpoint_name(before))
    if layout == "sharded":
        from koochak.loop.checkpoint.selection import resolve_sharded

        assert resolve_sharded(root)[1]["step"] == before


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_sharded_checkpoint_resumes_on_another_world_size(trained, mode):
    """Saved by 2 ranks, restored by one process without FSDP: the same global values."""
    run = trained("sharded", "one tier", mode)
    path, ckpt = resolve_auto_resume(run.first)
    model = world.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    assert restore_training_state(ckpt, model, optimizer) == world.STEPS
    _same(model.state_dict(), run.final["model"], "model")


# ---------------------------------------------------------------------------- ownership


def _store(location):
    return LocalStore(location) if isinstance(location, Path) else open_store(location)


def _snapshot(locations) -> dict:
    """Every object of every tier and its bytes."""
    found = {}
    for location in locations:
        store = _store(location)
        for info in store.list(""):
            found[(str(location), info.key)] = store.get(info.key)
    return found


def _claim(first, replicas, layout, mode, **more):
    from koochak.loop.config import resolve_train_config
    from koochak.loop.run_lease import claim_run

    fresh = more.pop("fresh", False)
    world.register_slow()  # an async first tier is slowdir://; the sharded runs registered it elsewhere
    cfg = world.train_cfg(str(first), replicas, layout, mode == "async", **more)
    return claim_run(resolve_train_config(cfg), 0, fresh=fresh)


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_every_tier_is_marked_for_the_run_its_checkpoints_name(trained, layout, tiers, mode):
    """Identity: each tier's marker names the run that wrote every checkpoint committed there."""
    from koochak.loop.checkpoint.tier_marker import read_marker

    run = trained(layout, tiers, mode)
    for location in [run.first, *run.replicas]:
        store = _store(location)
        marker = read_marker(store)
        assert marker is not None, location
        for step in _committed(location):
            assert load(store, checkpoint_name(step))["run_id"] == marker.run_id, (location, step)


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_another_run_is_refused_on_every_tier_and_changes_nothing(trained, layout, tiers, mode):
    """Lease, then marker: a run with another identity on these tiers is refused naming the
    owner, and every object of every tier is byte-identical afterwards."""
    from koochak.loop.checkpoint.tier_marker import read_marker
    from koochak.loop.config import ConfigError

    run = trained(layout, tiers, mode)
    owner = read_marker(_store(run.first)).run_id
    before = _snapshot([run.first, *run.replicas])
    with pytest.raises(ConfigError, match=f"run {owner!r}"):
        _claim(run.first, run.replicas, layout, mode, run_id="an-intruder")
    assert _snapshot([run.first, *run.replicas]) == before


def _markerless_copy(location: str, tmp_path: Path) -> Path | str:
    """A copy of replica ``location``, every object but its tier marker: a directory under
    ``tmp_path``, or for an S3 replica a fresh prefix of the same bucket (removed at the end)."""
    from koochak.loop.checkpoint.tier_marker import MARKER_KEY

    if "://" not in location:
        shutil.copytree(location, tmp_path / "replica")
        (tmp_path / "replica" / MARKER_KEY).unlink()
        return tmp_path / "replica"
    scheme, name = location.split("://", 1)
    copy = f"{name}-markerless-{uuid.uuid4().hex[:8]}"
    _S3_USED.append(copy)
    source, target = open_store(location), open_store(f"{scheme}://{copy}")
    for info in source.list(""):
        if info.key != MARKER_KEY:
            target.put(info.key, source.get(info.key))
    return f"{scheme}://{copy}"


@pytest.mark.parametrize("layout, tiers, mode", COMBOS)
def test_a_markerless_tier_of_another_run_is_refused_naming_it(trained, tmp_path, layout, tiers,
                                                               mode):  # fmt: skip
    """A tier holding another run's committed checkpoints and no marker (written before
    markers): refused naming the run found in its checkpoints, never adopted."""
    from koochak.loop.checkpoint.tier_marker import MARKER_KEY, read_marker
    from koochak.loop.config import ConfigError

    run = trained(layout, tiers, mode)
    owner = read_marker(_store(run.first)).run_id
    if run.replicas:  # the replica, copied without its marker, behind a new first tier
        tier = _markerless_copy(run.replicas[0], tmp_path)
        first, replicas = tmp_path / "first", [str(tier)]
    else:
        tier = first = _copy_first(run, tmp_path / "first")
        replicas = []
        (tier / MARKER_KEY).unlink()
    assert read_marker(_store(tier)) is None and _committed(tier)
    before = _snapshot([tier])
    with pytest.raises(ConfigError, match=f"no tier marker but holds .* run {owner!r}"):
        _claim(first, replicas, layout, mode, run_id="an-intruder")
    assert _snapshot([tier]) == before


@pytest.mark.parametrize("layout", [pytest.param(layout, marks=[pytest.mark.slow] * (layout == "sharded"))
                                    for layout in LAYOUTS])  # fmt: skip
def test_a_run_starting_over_owns_the_tier_and_sets_the_older_run_aside(trained, tmp_path,
                                                                        layout):  # fmt: skip
    """Selection and retention: a run starting over (--resume none) owns the tier; the older
    run's checkpoints are moved to superseded/ whole (still loadable there), never selected."""
    from koochak.loop.checkpoint.tier_marker import read_marker

    run = trained(layout, "one tier", "sync")
    owner = read_marker(_store(run.first)).run_id
    first = _copy_first(run, tmp_path / "first")
    steps = _committed(first)
    lease, run_id = _claim(first, [], layout, "sync", fresh=True)
    lease.release()
    assert run_id != owner and read_marker(LocalStore(first)).run_id == run_id
    assert resolve_auto_resume(first) is None
    (aside,) = (first / "superseded").iterdir()
    assert aside.name.startswith(owner) and _committed(aside) == steps
    _same(load(aside / checkpoint_name(world.STEPS))["model"], run.final["model"], "model")

"""A live publisher in another PID namespace (another container on the node) is never judged dead.

Two containers on one node share the hostname and the boot id but not the pid namespace: the
publisher's pid means another process (or none) on the other side. Its intent record must then
say "cannot tell", so that a rival publish of the name fails instead of deleting its object.
Both directions: the publisher inside a new namespace judged from outside, and the reverse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from koochak.storage import _publish_intent, artifact
from koochak.storage.store import LocalStore

NAME = "step000000001.pt"

PUBLISHER = textwrap.dedent(
    """
    import os, sys, time
    from koochak.storage import artifact
    from koochak.storage.store import LocalStore

    root, flag = sys.argv[1], sys.argv[2]

    def data():
        yield b"a" * 1000
        open(flag + ".started", "w").close()
        while not os.path.exists(flag):
            time.sleep(0.02)
        yield b"b" * 1000

    artifact.publish(LocalStore(root), sys.argv[3], data(), kind="checkpoint")
    """
)

RIVAL = textwrap.dedent(
    """
    import sys
    from koochak.storage import artifact
    from koochak.storage.store import LocalStore

    try:
        artifact.publish(LocalStore(sys.argv[1]), sys.argv[2], b"rival", kind="checkpoint")
    except FileExistsError as exc:
        print("refused:", exc)
    else:
        print("published")
    """
)


def _unshare() -> list[str]:
    tool = shutil.which("unshare")
    if tool is None:
        pytest.skip("needs util-linux unshare")
    probe = subprocess.run([tool, "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    return [tool, "--pid", "--fork", "--mount-proc"]


def _wait_for(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"publisher exited {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError("the publisher never started writing")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("publisher_inside", [True, False], ids=["publisher-in-ns", "rival-in-ns"])
def test_a_live_publisher_in_another_pid_namespace_is_not_judged_dead(tmp_path, publisher_inside):
    wrap = _unshare()
    root, flag = str(tmp_path / "store"), str(tmp_path / "go")
    os.mkdir(root)
    publisher = subprocess.Popen(
        [*(wrap if publisher_inside else []), sys.executable, "-c", PUBLISHER, root, flag, NAME],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(flag + ".started", publisher)
        record = _publish_intent.parse(
            LocalStore(root).get(NAME + _publish_intent.INTENT_SUFFIX), "intent"
        )
        assert record.pid_ns and record.pid_ns != _publish_intent._pid_ns() or not publisher_inside
        if publisher_inside:
            assert _publish_intent.why_dead(record) is None
            with pytest.raises(FileExistsError, match="is being published by pid"):
                artifact.publish(LocalStore(root), NAME, b"rival", kind="checkpoint")
        else:
            rival = subprocess.run(
                [*wrap, sys.executable, "-c", RIVAL, root, NAME],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert rival.stdout.startswith("refused:"), rival.stdout + rival.stderr
            assert "is being published by pid" in rival.stdout
    finally:
        open(flag, "w").close()
        publisher.wait(timeout=120)
    assert publisher.returncode == 0, publisher.stderr.read()
    _, data = artifact.read_verified(LocalStore(root), NAME)
    assert data == b"a" * 1000 + b"b" * 1000  # the live publisher's object survived the rival


def test_a_record_from_another_pid_namespace_cannot_prove_death_by_pid():
    mine = _publish_intent.ours(NAME)
    elsewhere = _publish_intent.Intent(**{**mine.__dict__, "pid_ns": "pid:[1]", "pid_start": 1})
    assert _publish_intent.why_dead(elsewhere) is None  # its pid means nothing here
    same = _publish_intent.Intent(**{**mine.__dict__, "pid_start": mine.pid_start + 1})
    assert _publish_intent.why_dead(same) == f"pid {mine.pid} is no longer running"
    expired = _publish_intent.Intent(**{**elsewhere.__dict__, "deadline": time.time() - 400})
    assert _publish_intent.why_dead(expired) == "its deadline passed"


def test_version_1_records_still_read_but_prove_nothing_by_pid():
    mine = _publish_intent.ours(NAME)
    fields = {"boot_id": mine.boot_id, "deadline": mine.deadline, "host": mine.host,
              "key": NAME, "pid": mine.pid, "pid_start": 1, "version": 1}  # fmt: skip
    old = json.dumps(fields).encode()
    record = _publish_intent.parse(old, "old.json")
    assert record.pid_ns == ""
    assert _publish_intent.why_dead(record) is None  # written before namespaces were recorded
    assert b'"version": 3' in mine.to_bytes() and b'"pid_ns"' in mine.to_bytes()

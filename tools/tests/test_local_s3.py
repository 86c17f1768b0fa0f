"""tools/local_s3.sh: its command line, and that what it starts is what the tests rely on (a
server that honours conditional writes, one that ignores them, two mounts of one bucket)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "local_s3.sh"


def _tool(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KOOCHAK_S3_DIR": str(state_dir)}
    return subprocess.run([str(TOOL), *args], capture_output=True, text=True, env=env, timeout=60)


def test_unknown_command_prints_usage_and_exits_64(tmp_path):
    done = _tool("restart", state_dir=tmp_path)
    assert done.returncode == 64 and "install|start|stop|status|env" in done.stderr


def test_status_of_nothing_started_says_so_and_fails(tmp_path):
    done = _tool("status", state_dir=tmp_path)
    assert done.returncode == 1
    assert "moto: stopped" in done.stdout and "s3fs: not mounted" in done.stdout


def test_env_names_the_endpoints_mounts_and_test_credentials(tmp_path):
    env = dict(line.split("=", 1) for line in _tool("env", state_dir=tmp_path).stdout.split())
    assert env["KOOCHAK_S3FS_MOUNT"] == f"{tmp_path}/mnt/s3fs"
    assert env["KOOCHAK_S3_ENDPOINT"].startswith("http://127.0.0.1:")
    assert env["AWS_ACCESS_KEY_ID"] == "test"


def _client(endpoint: str, local_s3):
    boto3 = pytest.importorskip("boto3")
    creds = local_s3.credentials
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        region_name=creds["AWS_DEFAULT_REGION"],
    )


def test_moto_refuses_a_second_conditional_put_and_rclone_serve_does_not(local_s3):
    key = f"tools-test/{uuid.uuid4().hex}"
    moto = _client(local_s3.endpoint, local_s3)
    moto.put_object(Bucket=local_s3.native_bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(moto.exceptions.ClientError) as lost:
        moto.put_object(Bucket=local_s3.native_bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert lost.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    nocond = _client(local_s3.nocond_endpoint, local_s3)
    nocond.put_object(Bucket=local_s3.nocond_bucket, Key=key, Body=b"first", IfNoneMatch="*")
    nocond.put_object(Bucket=local_s3.nocond_bucket, Key=key, Body=b"second", IfNoneMatch="*")
    body = nocond.get_object(Bucket=local_s3.nocond_bucket, Key=key)["Body"].read()
    assert body == b"second"


def test_both_mounts_show_the_bucket_the_servers_hold(local_s3):
    """Both mounts upload by the time close() returns (rclone with --vfs-cache-mode off). How
    stale each mount's view of the other's writes is belongs to the mount tests, not to this
    one."""
    s3 = _client(local_s3.endpoint, local_s3)
    for mount in (local_s3.s3fs_mount, local_s3.rclone_mount):
        name = f"tools-test-{uuid.uuid4().hex}.txt"
        (mount / name).write_bytes(b"through a mount")
        deadline = time.monotonic() + 60
        while True:
            try:
                body = s3.get_object(Bucket=local_s3.mount_bucket, Key=name)["Body"].read()
                break
            except s3.exceptions.NoSuchKey:
                if time.monotonic() > deadline:
                    pytest.fail(f"{mount} never uploaded {name}")
                time.sleep(0.5)
        assert body == b"through a mount"
        (mount / name).unlink()


def test_close_on_either_mount_returns_once_the_server_has_the_bytes(local_s3):
    s3 = _client(local_s3.endpoint, local_s3)
    for mount in (local_s3.s3fs_mount, local_s3.rclone_mount):
        name = f"tools-test-{uuid.uuid4().hex}.bin"
        data = os.urandom(3 << 20)
        (mount / name).write_bytes(data)  # returns after close()
        assert s3.get_object(Bucket=local_s3.mount_bucket, Key=name)["Body"].read() == data
        s3.delete_object(Bucket=local_s3.mount_bucket, Key=name)


def test_etags_stay_right_when_heads_race_a_put(local_s3):
    """moto computes an ETag lazily; the script makes it do so under the object's lock, or a HEAD
    racing the PUT's reply caches a wrong one (and rclone mount re-uploads "corrupted" files)."""
    import hashlib
    import threading

    s3 = _client(local_s3.endpoint, local_s3)
    key = f"tools-test/etag-{uuid.uuid4().hex}"
    data = os.urandom(32 << 20)
    done = threading.Event()

    def heads():
        while not done.is_set():
            try:
                s3.head_object(Bucket=local_s3.native_bucket, Key=key)
            except s3.exceptions.ClientError:
                pass

    watchers = [threading.Thread(target=heads) for _ in range(2)]
    for watcher in watchers:
        watcher.start()
    try:
        s3.put_object(Bucket=local_s3.native_bucket, Key=key, Body=data)
    finally:
        done.set()
        for watcher in watchers:
            watcher.join()
    etag = s3.head_object(Bucket=local_s3.native_bucket, Key=key)["ETag"].strip('"')
    assert etag == hashlib.md5(data).hexdigest()
    s3.delete_object(Bucket=local_s3.native_bucket, Key=key)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _daemon_of(mount: Path) -> int:
    """The pid of the FUSE daemon serving ``mount`` (one this test's script started)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if args and Path(os.fsdecode(args[0])).name == "s3fs" and os.fsencode(mount) in args:
                return int(entry.name)
    raise AssertionError(f"no s3fs daemon serves {mount}")


@pytest.mark.slow
def test_start_recovers_what_a_killed_or_older_run_left(local_s3):
    """CI machines keep what killed runs left: a pid file naming an older moto (without the ETag
    fix), a mount made with other settings, a mount whose daemon died. status says so and fails;
    start replaces each, without touching the shared stack (its own state dir and ports)."""
    import hashlib
    import shutil
    import signal
    import sys
    import tempfile

    # One state dir per checkout, so a run of this test that was killed is cleaned up by the next
    # (its mounts detached and its servers stopped by the script's own stop), never leaked.
    checkout = hashlib.sha256(os.fsencode(TOOL)).hexdigest()[:8]
    state = Path(tempfile.gettempdir(), f"koochak-s3-selftest-{checkout}")
    env = {
        **os.environ,
        "KOOCHAK_S3_DIR": str(state),
        "KOOCHAK_S3_PORT": str(_free_port()),
        "KOOCHAK_S3_NOCOND_PORT": str(_free_port()),
    }

    def tool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(TOOL), *args], capture_output=True, text=True, env=env, timeout=120
        )

    if state.exists():
        tool("stop")
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(exist_ok=True)
    (state / "venv").unlink(missing_ok=True)
    (state / "venv").symlink_to(Path(local_s3.env["KOOCHAK_S3_RCLONE"]).parents[1])

    older_moto = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "moto_server"]
    )
    try:
        (state / "moto.pid").write_text(f"{older_moto.pid}\n")
        assert "moto: running without the ETag fix" in tool("status").stdout
        started = tool("start")
        assert started.returncode == 0, started.stderr
        assert "restarting moto" in started.stderr
        assert older_moto.wait(timeout=10) is not None
        assert tool("status").returncode == 0

        (state / "s3fs.settings").write_text("-o some -o other settings\n")
        status = tool("status")
        assert status.returncode == 1 and "s3fs: mounted with other settings" in status.stdout
        started = tool("start")
        assert started.returncode == 0 and "remounting s3fs" in started.stderr, started.stderr
        assert tool("status").returncode == 0

        daemon = _daemon_of(state / "mnt" / "s3fs")
        os.kill(daemon, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{daemon}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        status = tool("status")
        assert status.returncode == 1 and "s3fs: not mounted" in status.stdout
        started = tool("start")
        assert started.returncode == 0 and "its daemon is gone" in started.stderr, started.stderr
        assert tool("status").returncode == 0
        (state / "mnt" / "s3fs" / "through-the-new-mount").write_bytes(b"ok")
    finally:
        tool("stop")
        if older_moto.poll() is None:
            older_moto.kill()
            older_moto.wait()
    assert "s3fs: not mounted" in tool("status").stdout
    shutil.rmtree(state, ignore_errors=True)


def test_start_refuses_a_port_that_something_else_holds(local_s3, tmp_path):
    """A server a killed run left without its pid file would answer the tests in place of the one
    start launches (which then fails to bind): start says so instead."""
    import socket

    (tmp_path / "venv").symlink_to(Path(local_s3.env["KOOCHAK_S3_RCLONE"]).parents[1])
    with socket.socket() as orphan:
        orphan.bind(("127.0.0.1", 0))
        orphan.listen()
        env = {
            **os.environ,
            "KOOCHAK_S3_DIR": str(tmp_path),
            "KOOCHAK_S3_PORT": str(orphan.getsockname()[1]),
            "KOOCHAK_S3_NOCOND_PORT": str(_free_port()),
        }
        done = subprocess.run(
            [str(TOOL), "start"], capture_output=True, text=True, env=env, timeout=60
        )
    assert done.returncode == 1
    assert f"port {env['KOOCHAK_S3_PORT']} is taken" in done.stderr
    assert "not by a moto this script started" in done.stderr
    assert not (tmp_path / "moto.pid").exists()

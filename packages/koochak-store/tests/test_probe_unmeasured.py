"""koochak-probe without --peer claims nothing about other clients (issue 28, item 5).

Through one s3fs mount, ``O_EXCL`` is refused and a closed file reads back at once — for this
client. Two clients of the same bucket can both create a name, and another client may not see a
just-closed file for seconds. Without a second view the probe must report those properties as
unmeasured and recommend the settings that are safe without them.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid

import pytest
from koochak.storage import _probe_semantics as semantics
from koochak.storage.probe import format_report, main, probe

SMALL = dict(
    read_bytes=64 << 10, streams=(1, 2), small_objects=5, read_back_timeout=10.0, drop_caches=False
)


def _assert_unmeasured_and_safe(report) -> None:
    checks = {check.name: check for check in report.checks}
    for name in ("exclusive_create_across_clients", "peer_sees_new_objects"):
        assert checks[name].supported is None, checks[name]
        assert "unmeasured" in checks[name].detail
    assert "this client only" in checks["exclusive_create"].detail
    settings = report.settings
    assert settings is not None and settings["publish"] == "exclusive"
    assert settings["verify_readback"] is True  # the loser of a two-client create finds out
    assert settings["settle_seconds"] >= semantics.UNMEASURED_SETTLE_SECONDS
    assert settings["read_settle_seconds"] >= semantics.UNMEASURED_READ_SETTLE_SECONDS
    text = format_report(report)
    assert "run --peer from a second node" in text
    assert "backend: s3" in text and "publish: exclusive alone" in text


def test_unmeasured_cross_client_checks_make_exclusive_mode_advice_safe():
    local = [
        semantics.Check("hard_links", False, "EPERM"),
        semantics.Check("exclusive_create", True, "refused"),
        semantics.Check("rename", True, ""),
        semantics.Check("fsync", True, ""),
        semantics.Check("read_back", True, "at once", 0.0),
        semantics.Check("publish_lock", True, ""),
    ]
    trusting = semantics.recommend_settings(local)
    assert trusting["verify_readback"] is False and trusting["settle_seconds"] == 0.0
    unmeasured = [semantics.Check(n, None, "unmeasured") for n in semantics.CROSS_CLIENT_CHECKS]
    safe = semantics.recommend_settings(local + unmeasured)
    assert safe == {
        "publish": "exclusive",
        "fsync": True,
        "verify_readback": True,
        "settle_seconds": semantics.UNMEASURED_SETTLE_SECONDS,
        "read_settle_seconds": semantics.UNMEASURED_READ_SETTLE_SECONDS,
    }
    # link mode is create-only at the server whichever client asks: unmeasured changes nothing
    linked = [semantics.Check("hard_links", True, ""), *local[1:], *unmeasured]
    assert semantics.recommend_settings(linked)["verify_readback"] is False


def test_a_directory_without_hard_links_gets_the_safe_advice(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    _assert_unmeasured_and_safe(probe(tmp_path, **SMALL))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_plain_probe_of_a_real_s3fs_mount_says_what_it_cannot_see(local_s3, capsys):
    where = local_s3.s3fs_mount / f"t-{uuid.uuid4().hex[:12]}"
    where.mkdir()
    try:
        _assert_unmeasured_and_safe(probe(where, **SMALL))
        args = [str(where), "--read-bytes", "64K", "--streams", "1", "--small-objects", "3",
                "--no-drop-caches", "--rounds", "1"]  # fmt: skip
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "exclusive_create_across_clients" in out and "unmeasured" in out
        assert "run --peer from a second node" in out
        assert "verify_readback: true" in out
    finally:
        shutil.rmtree(where, ignore_errors=True)

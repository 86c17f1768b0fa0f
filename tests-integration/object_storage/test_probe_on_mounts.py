"""koochak-probe --peer on each mount, with the other mount as the peer: it recommends exactly the
settings the tests on that mount run with (conftest.MOUNT_SETTINGS), and three runs agree."""

from __future__ import annotations

import pytest
from koochak.storage.probe import probe

pytestmark = pytest.mark.slow

SMALL = dict(
    read_bytes=2 << 20,
    streams=(1, 2),
    small_objects=5,
    read_back_timeout=30.0,
    drop_caches=False,
    rounds=3,
)


def test_three_probes_recommend_the_settings_the_mount_tests_use(mount_dir):
    reports = [probe(mount_dir.path, peer=mount_dir.peer, **SMALL) for _ in range(3)]
    for report in reports:
        assert report.settings == mount_dir.settings, report.checks
        checks = {check.name: check.supported for check in report.checks}
        assert checks["exclusive_create_across_clients"] is False
        assert checks["rename_whole_across_clients"] is True
        assert checks["fsync_reaches_server"] is (mount_dir.name == "s3fs")
    # The advice agrees; part_bytes follows the measured request cost and bandwidth (1-2-5
    # figures), which on a loaded two-core machine can move a grid step between runs.
    advice = {(r.profile.concurrency, r.profile.range_reads_scale, r.profile.listing_cheap)
              for r in reports}  # fmt: skip
    assert len(advice) == 1, advice

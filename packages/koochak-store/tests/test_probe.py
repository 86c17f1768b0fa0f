"""koochak-probe: semantics checks, recommendations, measurements, CLI and cleanup (tiny sizes)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from koochak.storage import _probe_semantics as semantics
from koochak.storage._probe_measure import Measurement, recommend_profile
from koochak.storage.probe import PROBE_MODES_GROUP, REPORT_VERSION, format_report, main, probe
from koochak.storage.profile import StoreProfile
from koochak.storage.store import LocalStore, StoreCapabilities, register_store

TINY = dict(
    read_bytes=64 << 10,
    streams=(1, 2),
    small_objects=5,
    read_back_timeout=2.0,
    drop_caches=False,  # never drop the whole node's page cache from a test
)
TINY_ARGS = ["--read-bytes", "64K", "--streams", "1,2", "--small-objects", "5", "--no-drop-caches"]


def _leftovers(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def test_probe_of_a_directory_checks_measures_recommends_and_cleans_up(tmp_path):
    report = probe(tmp_path, checkpoint_bytes=32 << 10, checkpoint_parts=(1, 3), **TINY)
    assert _leftovers(tmp_path) == []
    checks = {check.name: check for check in report.checks}
    assert set(checks) == {
        "exclusive_create",
        "rename",
        "hard_links",
        "symlinks",
        "fsync",
        "in_place_writes",
        "unclosed_visibility",
        "read_back",
        "publish_lock",
        *semantics.CROSS_CLIENT_CHECKS,  # without --peer: reported, as unmeasured
    }
    assert checks["exclusive_create"].supported and checks["hard_links"].supported
    assert report.settings is not None and report.settings["publish"] == "link"
    assert isinstance(report.profile, StoreProfile)
    metrics = {(row.metric, row.streams) for row in report.measurements}
    for expected in [
        ("small_put", 1),
        ("small_get_cold", 1),
        ("list", 1),
        ("single_stream_cold", 1),
        ("single_stream_cached", 1),
        ("range_parallel_cold", 2),
        ("concurrent_cold", 2),
        ("checkpoint_write", 3),
        ("checkpoint_read_back", 1),
    ]:
        assert expected in metrics
    assert all(row.value > 0 for row in report.measurements)
    assert "posix_fadvise" in report.cache_drop


def test_json_report_is_versioned_and_complete(tmp_path, capsys):
    assert main([str(tmp_path), "--json", *TINY_ARGS]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["version"] == REPORT_VERSION
    assert document["settings"]["publish"] == "link"
    assert StoreProfile(**document["profile"])
    assert {row["metric"] for row in document["measurements"]} >= {"small_put", "concurrent_cold"}
    assert _leftovers(tmp_path) == []


def test_emit_profile_prints_only_a_yaml_profile_block(tmp_path, capsys):
    assert main([str(tmp_path), "--emit-profile", *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    assert out.startswith("profile:\n")
    block = yaml.safe_load(out)
    assert list(block) == ["profile"]
    assert StoreProfile(**block["profile"])


def test_table_output_names_every_section(tmp_path, capsys):
    assert main([str(tmp_path), *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    for heading in ("Semantics", "Recommended LocalStore settings", "Measurements", "profile:"):
        assert heading in out


def test_missing_directory_is_a_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main([str(missing), *TINY_ARGS]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "Traceback" not in err


def test_bad_size_argument_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--read-bytes", "12Q"])
    assert exit_info.value.code == 2
    assert "12Q" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--small-objects", "0", "small_objects"),
        ("--dataset-shards", "0", "dataset_shards"),
        ("--read-back-timeout", "-1", "read_back_timeout"),
    ],
)
def test_out_of_range_numbers_are_one_line_errors_before_anything_is_written(
    tmp_path, capsys, flag, value, named
):
    assert main([str(tmp_path), *TINY_ARGS, flag, value]) == 1  # last one wins
    err = capsys.readouterr().err
    assert err.startswith("koochak-probe: ") and named in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_dataset_mode_without_koochak_data_says_what_to_install(tmp_path, monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def without_data(name, *args, **kwargs):
        if name.startswith("koochak.data"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="koochak.data")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_data)
    assert main([str(tmp_path), "--dataset-shards", "2", "--shard-bytes", "4K", *TINY_ARGS]) == 1
    assert "pip install koochak-data" in capsys.readouterr().err
    assert _leftovers(tmp_path) == []  # refused before writing anything


def test_dataset_mode_is_found_through_its_entry_point_only(tmp_path, monkeypatch, capsys):
    # koochak-store names no higher package: with nothing registered under koochak.probe_modes
    # (koochak-data absent), the mode says what to install, before writing anything.
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    assert main([str(tmp_path), "--dataset-shards", "2", "--shard-bytes", "4K", *TINY_ARGS]) == 1
    err = capsys.readouterr().err
    assert "pip install koochak-data" in err and err.count("\n") == 1
    assert _leftovers(tmp_path) == []


def test_two_providers_of_the_dataset_mode_are_refused(tmp_path, monkeypatch, capsys):
    import importlib.metadata

    claims = [
        importlib.metadata.EntryPoint("dataset_shards", f"{name}:measure", PROBE_MODES_GROUP)
        for name in ("one", "two")
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: claims)
    assert main([str(tmp_path), "--dataset-shards", "2", "--shard-bytes", "4K", *TINY_ARGS]) == 1
    err = capsys.readouterr().err
    assert "one:measure, two:measure" in err and err.count("\n") == 1
    assert _leftovers(tmp_path) == []


def test_uri_location_uses_the_configured_store(tmp_path):
    register_store("probetest", lambda path: LocalStore(tmp_path / path))
    (tmp_path / "tier").mkdir()
    report = probe("probetest://tier", **TINY)
    assert report.checks and report.profile is not None
    assert any("configured store settings" in note for note in report.notes)
    assert _leftovers(tmp_path / "tier") == []


def test_non_local_store_is_measured_through_the_api_and_emptied(tmp_path):
    inner = LocalStore(tmp_path)

    class Remote:  # a Store with no local paths, as an object-storage backend would be
        location = "remote://bucket"

        def __getattr__(self, name):
            return getattr(inner, name)

        def local_path(self, key):
            return None

        def capabilities(self):  # declares nothing of the LocalStore it forwards to
            return StoreCapabilities()

    register_store("probetestremote", lambda path: Remote())
    report = probe("probetestremote://bucket", **TINY)
    assert report.checks == () and report.settings is None
    assert report.profile is not None
    assert report.cache_drop.startswith("none")
    assert inner.list() == []


def test_a_non_local_store_may_report_its_own_semantics_checks(tmp_path):
    inner = LocalStore(tmp_path)
    asked = []

    class Remote:
        location = "remote://bucket"

        def __getattr__(self, name):
            return getattr(inner, name)

        def local_path(self, key):
            return None

        def capabilities(self):
            return StoreCapabilities(probe_checks=True)

        def probe_checks(self, prefix):
            asked.append(prefix)
            return [{"name": "conditional_create", "supported": False,
                     "detail": "a second create overwrote", "seconds": 0.01}]  # fmt: skip

    register_store("probetestchecks", lambda path: Remote())
    report = probe("probetestchecks://bucket", **TINY)
    [check] = report.checks
    assert (check.name, check.supported) == ("conditional_create", False)
    assert asked == [report.scratch.rsplit("/", 2)[-2] + "/"]
    assert "conditional_create" in format_report(report)


# -- semantics checks with injected failures --------------------------------------------------


def test_no_hard_links_recommends_exclusive_publication(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    checks = semantics.run_checks(tmp_path, read_back_timeout=1.0)
    assert {c.name: c.supported for c in checks}["hard_links"] is False
    assert "EPERM" in {c.name: c.detail for c in checks}["hard_links"]
    assert semantics.recommend_settings(checks)["publish"] == "exclusive"


def test_neither_links_nor_exclusive_create_is_unsafe():
    checks = [
        semantics.Check("hard_links", False, "EPERM"),
        semantics.Check("exclusive_create", False, "a second create succeeded"),
    ]
    with pytest.raises(ValueError, match="neither"):
        semantics.recommend_settings(checks)


def test_failing_fsync_recommends_no_fsync_and_read_back_verification(tmp_path, monkeypatch):
    def no_fsync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", no_fsync)
    check = semantics.check_fsync(tmp_path)
    assert check.supported is False and "EINVAL" in check.detail
    settings = semantics.recommend_settings(
        [
            semantics.Check("hard_links", True, ""),
            check,
            semantics.Check("read_back", True, "", 0.0),
        ]
    )
    assert settings["fsync"] is False and settings["verify_readback"] is True


def test_settling_errors_on_read_back_recommend_read_retries(tmp_path, monkeypatch):
    real = semantics._read_file
    failures = iter([errno.ETIME, errno.EIO])

    def flaky(path):
        code = next(failures, None)
        if code is not None:
            raise OSError(code, os.strerror(code))
        return real(path)

    monkeypatch.setattr(semantics, "_read_file", flaky)
    check = semantics.check_read_back(tmp_path, timeout=5.0)
    assert check.supported is False and "ETIME" in check.detail and check.seconds is not None
    settings = semantics.recommend_settings([semantics.Check("hard_links", True, ""), check])
    assert settings["read_settle_seconds"] > 0 and settings["verify_readback"] is True


def test_read_back_that_never_settles_reports_the_timeout(tmp_path, monkeypatch):
    def always(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(semantics, "_read_file", always)
    check = semantics.check_read_back(tmp_path, timeout=0.1)
    assert check.supported is False and "still not readable" in check.detail


def test_second_exclusive_create_succeeding_is_reported(tmp_path, monkeypatch):
    real_open = os.open

    def lax_open(path, flags, mode=0o777):
        return real_open(path, flags & ~os.O_EXCL, mode)

    monkeypatch.setattr(os, "open", lax_open)
    check = semantics.check_exclusive_create(tmp_path)
    assert check.supported is False and "succeeded" in check.detail


# -- the recommended profile ------------------------------------------------------------------


def _rows(concurrent: dict[int, float], ranged: dict[int, float], request=0.5, stream=50e6):
    rows = [
        Measurement("small_get_cold", 1, request, "s"),
        Measurement("single_stream_cold", 1, stream, "B/s"),
        Measurement("list", 1, 2.0, "s"),
    ]
    rows += [Measurement("concurrent_cold", n, v, "B/s") for n, v in concurrent.items()]
    rows += [Measurement("range_parallel_cold", n, v, "B/s") for n, v in ranged.items()]
    return rows


def test_profile_for_a_slow_remote_mount():
    profile = recommend_profile(
        _rows({1: 50e6, 4: 190e6, 16: 700e6}, {1: 50e6, 4: 180e6, 16: 600e6})
    )
    assert profile.concurrency == 16
    assert profile.range_reads_scale is True
    assert profile.part_bytes == 256 << 20  # 20 x 0.5 s x 50 MB/s = 500 MB, capped
    assert profile.listing_cheap is False


def test_profile_for_a_fast_local_disk():
    profile = recommend_profile(
        _rows({1: 1e9, 4: 1.95e9, 16: 2e9}, {1: 1e9, 4: 1.1e9, 16: 1.1e9}, request=1e-4, stream=1e9)
    )
    assert profile.concurrency == 4
    assert profile.range_reads_scale is False
    assert profile.part_bytes == 8 << 20


# -- interruption -----------------------------------------------------------------------------


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default. A process started with SIGINT
    ignored (a job run with ``&`` by a non-interactive shell, ``nohup``, some CI runners) hands
    that on, and Python then installs no KeyboardInterrupt handler, so the test's Ctrl-C would
    reach nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_probe_removes_its_scratch_directory(tmp_path, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "koochak.storage.probe",
            str(tmp_path),
            "--small-objects",
            "1000000",
            "--no-drop-caches",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            small = list(tmp_path.glob("koochak-probe-*/store/small"))
            if small and len(os.listdir(small[0])) > 20:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert _leftovers(tmp_path) == []


def test_emitted_profile_pastes_into_a_stores_file(tmp_path, capsys):
    from koochak.storage.stores_file import load_stores_file

    data = tmp_path / "data"
    data.mkdir()
    assert main([str(data), "--emit-profile", *TINY_ARGS]) == 0
    block = capsys.readouterr().out
    stores = tmp_path / "stores.yaml"
    indented = "".join("    " + line + "\n" for line in block.splitlines())
    stores.write_text(f"version: 1\nstores:\n  probed:\n    root: {data}\n{indented}")
    settings = load_stores_file(stores)["probed"]
    assert settings.profile == StoreProfile(**yaml.safe_load(block)["profile"])


@pytest.mark.slow
def test_console_script_runs_end_to_end(tmp_path):
    script = Path(sys.executable).with_name("koochak-probe")
    if not script.exists():
        pytest.skip("koochak-probe console script not installed in this environment")
    result = subprocess.run(
        [str(script), str(tmp_path), "--json", *TINY_ARGS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["version"] == REPORT_VERSION
    assert _leftovers(tmp_path) == []
    bad = subprocess.run([str(script), str(tmp_path / "missing")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("koochak-probe: ")
    assert "Traceback" not in bad.stderr

"""koochak-probe: what a filesystem or store guarantees, how fast it is, and how to configure it.

``koochak-probe <path-or-uri>`` (also ``python -m koochak.storage.probe``) works in a scratch
directory it creates under the location and removes afterwards, even on Ctrl-C:

1. semantics, with plain ``os`` calls: exclusive create, rename, hard links, symlinks, fsync,
   in-place writes, visibility of unclosed files, read-back delay, the publish lock; with
   ``--peer`` (a second view of the same storage) also what other clients see: how long until
   they find and list a new object, whether create-only holds between clients, whether fsync
   puts the bytes on the server, whether a rename appears whole -> recommended LocalStore
   settings;
2. measurements through the Store API: small-object latency, listing, cold and cached single
   stream, concurrent objects, parallel ranges of one object -> a recommended StoreProfile;
3. optionally a checkpoint-sized write in 1..N parts, and a synthetic sharded dataset read by
   N spawned processes (that mode is ``koochak.data.probe_shards``, found through the
   ``koochak.probe_modes`` entry point: it needs ``koochak-data`` installed).

Run it on a compute node, against the storage the jobs will use.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from koochak.storage._probe_measure import (
    CacheDropper,
    Measurement,
    human_size,
    measure_checkpoint,
    measure_reads,
    measure_small_objects,
    recommend_profile,
)
from koochak.storage._probe_semantics import (
    CROSS_CLIENT_CHECKS,
    UNMEASURED_READ_SETTLE_SECONDS,
    UNMEASURED_SETTLE_SECONDS,
    Check,
    recommend_settings,
    run_checks,
)
from koochak.storage.profile import StoreProfile, parse_size
from koochak.storage.store import (
    LocalStore,
    Store,
    StoreCapabilities,
    capabilities_of,
    open_store,
)

__all__ = [
    "ProbeReport",
    "Measurement",
    "probe",
    "main",
    "human_size",
    "REPORT_VERSION",
    "PROBE_MODES_GROUP",
]

REPORT_VERSION = 2
SCRATCH_PREFIX = "koochak-probe-"
# Entry points that measure what koochak-store cannot import: "dataset_shards" (koochak-data).
PROBE_MODES_GROUP = "koochak.probe_modes"


@dataclass(frozen=True)
class ProbeReport:
    """Everything one probe run found. ``to_json()`` is the ``--json`` document."""

    location: str
    scratch: str
    checks: tuple[Check, ...]
    settings: dict[str, object] | None  # recommended LocalStore keyword arguments
    profile: StoreProfile | None
    measurements: tuple[Measurement, ...]
    cache_drop: str
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, object]:
        return {
            "version": REPORT_VERSION,
            "location": self.location,
            "scratch": self.scratch,
            "checks": [asdict(check) for check in self.checks],
            "settings": self.settings,
            "profile": asdict(self.profile) if self.profile is not None else None,
            "measurements": [asdict(row) for row in self.measurements],
            "cache_drop": self.cache_drop,
            "notes": list(self.notes),
        }


def probe(
    location: str | os.PathLike[str],
    *,
    read_bytes: int = 256 << 20,
    streams: Sequence[int] = (1, 4, 16),
    small_objects: int = 100,
    checkpoint_bytes: int | None = None,
    checkpoint_parts: Sequence[int] = (1, 8),
    dataset_shards: int | None = None,
    shard_bytes: int = 256 << 20,
    readers: Sequence[int] = (1, 4, 16),
    read_back_timeout: float = 10.0,
    drop_caches: bool = True,
    stage: Callable[[str], None] | None = None,
    peer: str | os.PathLike[str] | Store | None = None,
    rounds: int = 3,
) -> ProbeReport:
    """Probe ``location`` (a directory, ``file://`` URI or any ``open_store`` URI).

    Writes only under a new scratch directory/prefix named ``koochak-probe-<host>-<pid>-<hex>``
    and removes it before returning, also when interrupted. Before cold reads the page cache of
    the objects read is dropped with posix_fadvise; ``drop_caches=True`` also writes
    /proc/sys/vm/drop_caches when that is allowed (root), which drops the whole node's cache.

    ``peer`` is another view of the same storage (another mount point of the bucket, the same
    directory through another path, or an ``open_store`` location of it): the cross-client
    checks write on one side and watch the other. Each timed check runs ``rounds`` times and
    the recommendations use the medians and maxima, rounded to a grid, so reruns agree.
    """
    _check_arguments(
        read_bytes,
        streams,
        small_objects,
        checkpoint_bytes,
        checkpoint_parts,
        dataset_shards,
        shard_bytes,
        readers,
        read_back_timeout,
    )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"probe: rounds must be an int >= 1, got {rounds!r}")
    dataset = _dataset_mode() if dataset_shards else None  # fail before writing anything
    say = stage or (lambda _message: None)
    store, root = _resolve(location)
    name = f"{SCRATCH_PREFIX}{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    scratch_dir = root / name if root is not None else None
    if scratch_dir is not None:
        try:
            scratch_dir.mkdir()
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot create the probe's scratch directory: {exc.strerror}",
                str(scratch_dir),
            ) from None
    notes: list[str] = []
    work: Store | None = None
    try:
        checks: list[Check] = []
        settings: dict[str, object] | None = None
        if scratch_dir is not None:
            say("checking filesystem semantics")
            semantics = scratch_dir / "semantics"
            semantics.mkdir()
            checks = run_checks(semantics, read_back_timeout, rounds)
            if peer is not None:
                say("checking what the peer sees")
                checks += _peer_checks(scratch_dir, name, peer, rounds, read_back_timeout)
            else:
                checks = _this_client_only(checks)
            try:
                settings = recommend_settings(checks)
            except ValueError as exc:
                notes.append(str(exc))
            notes += _peer_notes(checks, peer, settings)
        elif peer is not None:
            notes.append("--peer needs a directory location (or a scheme that is a directory)")
        if store is None and settings is not None:
            # With verify_readback every put would wait settle_seconds before reading back (to
            # catch another client's replacement): a fixed wait per put, not a cost to measure.
            measured = {**settings, "settle_seconds": 0.0}
            work = LocalStore(scratch_dir / "store", **measured)  # type: ignore[arg-type, operator]
        elif store is not None and root is not None:
            work = _Prefixed(store, f"{name}/store/")
            notes.append(f"measured with the configured store settings of {store.location}")
        elif store is not None:
            work = _Prefixed(store, f"{name}/")
            say("checking the store's semantics")
            checks = _store_checks(store, f"{name}/")
        measurements: list[Measurement] = []
        profile = None
        dropper = CacheDropper(work, drop_caches) if work is not None else None
        if work is not None and dropper is not None:
            say(f"timing {small_objects} small objects")
            measurements += measure_small_objects(work, dropper, small_objects)
            say(f"reading {human_size(read_bytes)} with {', '.join(map(str, streams))} streams")
            measurements += measure_reads(work, dropper, read_bytes, streams, rounds)
            profile = recommend_profile(measurements)
            if checkpoint_bytes:
                say(f"writing a {human_size(checkpoint_bytes)} checkpoint")
                measurements += measure_checkpoint(
                    work, dropper, checkpoint_bytes, checkpoint_parts
                )
            if dataset is not None and dataset_shards:
                say(f"building {dataset_shards} shards of {human_size(shard_bytes)}")
                measurements += dataset(
                    work,
                    shards=dataset_shards,
                    shard_bytes=shard_bytes,
                    readers=readers,
                    drop_cache=dropper.drop,
                    notes=notes,
                )
        return ProbeReport(
            location=str(location),
            scratch=str(scratch_dir) if scratch_dir is not None else f"{store.location}/{name}/",  # type: ignore[union-attr]
            checks=tuple(checks),
            settings=settings,
            profile=profile,
            measurements=tuple(measurements),
            cache_drop=dropper.method if dropper is not None else "not measured",
            notes=tuple(notes),
        )
    finally:
        say("removing the scratch directory")
        _shielded(lambda: _cleanup(scratch_dir, work if scratch_dir is None else None))


def _peer_checks(
    scratch_dir: Path, name: str, peer: str | os.PathLike[str] | Store, rounds: int, timeout: float
) -> list[Check]:
    """The cross-client checks in ``scratch_dir/peer``, seen through ``peer``."""
    from koochak.storage._probe_peer import PeerView, run_peer_checks, unreachable

    view = PeerView(peer, name)
    work = scratch_dir / "peer"
    work.mkdir()
    # A peer that caches listings for minutes would make every check time out: give up early,
    # naming the setting, when it cannot even see a marker object.
    problem = unreachable(work, view, "peer", timeout)
    if problem is not None:
        raise ValueError(f"probe: {problem}")
    return run_peer_checks(work, view, "peer", rounds, timeout)


def _this_client_only(checks: list[Check]) -> list[Check]:
    """Without --peer: say that the local checks saw one client, and add every cross-client
    property as unmeasured (``supported`` None), so that neither the report nor the settings
    derived from it claim what one client cannot see."""
    local = {"exclusive_create", "read_back", "publish_lock"}
    marked = [
        Check(c.name, c.supported, f"{c.detail} (this client only)", c.seconds)
        if c.name in local
        else c
        for c in checks
    ]
    return marked + [
        Check(name, None, f"unmeasured without --peer: {what}")
        for name, what in CROSS_CLIENT_CHECKS.items()
    ]


def _peer_notes(
    checks: Sequence[Check], peer: object, settings: dict[str, object] | None = None
) -> list[str]:
    """What the report must say about cross-client facts: unmeasured, or what they mean."""
    by_name = {check.name: check for check in checks}
    notes = []
    unmeasured = [name for name in CROSS_CLIENT_CHECKS
                  if name in by_name and by_name[name].supported is None]  # fmt: skip
    if unmeasured:
        assumed = (
            "the recommended settings assume the worst of them (verify_readback, "
            f"settle_seconds >= {UNMEASURED_SETTLE_SECONDS:g}, read_settle_seconds >= "
            f"{UNMEASURED_READ_SETTLE_SECONDS:g})"
            if settings is not None and settings.get("publish") == "exclusive"
            else "hard links publish create-only at the server, whichever client asks"
        )
        notes.append(
            f"cross-client semantics are unmeasured ({', '.join(unmeasured)}): one client cannot "
            f"see what others see; {assumed}. To measure them, run koochak-probe with --peer "
            "from a second node (or with a second mount of the same storage): --peer "
            "<that view of the same storage>"
        )
        if settings is not None and settings.get("publish") == "exclusive":
            notes.append(
                "no hard links here, as on FUSE mounts of object storage (s3fs, rclone, "
                "Mountpoint), where two clients can both create one name and the last upload "
                "wins (docs/storage.md): do not rely on publish: exclusive alone there. Write "
                "through the object store's own API where you can (stores file: backend: s3, "
                "conditional writes); through the mount keep verify_readback with a "
                "settle_seconds at least as long as other clients take to see an object"
            )
    if peer is None:
        return notes
    fsync = by_name.get("fsync_reaches_server")
    if fsync is not None and fsync.supported is False and fsync.seconds is not None:
        if fsync.seconds <= 0.5:
            notes.append(
                "fsync does not put the bytes on the server but close() does: put closes "
                "before it returns, so it returns once the server has them"
            )
        else:
            notes.append(
                f"the peer saw a closed file only {fsync.seconds:.1f} s after close(): unless "
                "the peer itself caches that long, this mount uploads after close and put "
                "returns before the server has the bytes; a crash then loses them (rclone "
                "mount: use --vfs-cache-mode off, which uploads before close returns)"
            )
    listed, found = by_name.get("peer_lists_new_objects"), by_name.get("peer_sees_new_objects")
    if (
        listed is not None
        and found is not None
        and (listed.seconds or 0) > (found.seconds or 0) + 2
    ):
        notes.append(
            f"the peer lists new objects only after {listed.seconds:.0f} s: a reader there "
            "resuming from the newest checkpoint may not see it (rclone mount: --dir-cache-time)"
        )
    exclusive = by_name.get("exclusive_create_across_clients")
    if exclusive is not None and exclusive.supported is False:
        notes.append(
            "two clients can both create one name: verify_readback (with settle_seconds) makes "
            "the writer whose object was replaced fail loudly instead of succeeding silently"
        )
    return notes


def _check_arguments(
    read_bytes,
    streams,
    small_objects,
    checkpoint_bytes,
    checkpoint_parts,
    dataset_shards,
    shard_bytes,
    readers,
    read_back_timeout,
) -> None:
    if (
        isinstance(read_back_timeout, bool)
        or not isinstance(read_back_timeout, (int, float))
        or not read_back_timeout >= 0
    ):
        raise ValueError(
            f"probe: read_back_timeout must be a number of seconds >= 0, got {read_back_timeout!r}"
        )
    for name, value, low in (
        ("read_bytes", read_bytes, 1),
        ("small_objects", small_objects, 1),
        ("shard_bytes", shard_bytes, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"probe: {name} must be an int >= {low}, got {value!r}")
    for name, value in (("checkpoint_bytes", checkpoint_bytes), ("dataset_shards", dataset_shards)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"probe: {name} must be an int >= 1 or None, got {value!r}")
    for name, values in (
        ("streams", streams),
        ("checkpoint_parts", checkpoint_parts),
        ("readers", readers),
    ):
        if not values or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values
        ):
            raise ValueError(f"probe: {name} must be a non-empty list of ints >= 1, got {values!r}")


def _dataset_mode() -> Callable[..., list[Measurement]]:
    """The --dataset-shards measurement, ``koochak.data.probe_shards.measure_dataset``.

    koochak-data sits above koochak-store, so the store never imports it: koochak-data registers
    the measurement as ``dataset_shards`` in the ``koochak.probe_modes`` entry-point group, and
    the probe loads whatever is registered there, only for this mode. It is called as
    ``measure(store, shards=, shard_bytes=, readers=, drop_cache=, notes=)`` and returns
    Measurement rows. Without koochak-data the probe says what to install.
    """
    import importlib
    from importlib.metadata import entry_points

    missing = ModuleNotFoundError(
        "the dataset-shard mode (--dataset-shards) needs koochak-data: pip install koochak-data"
    )
    values = {ep.value: ep for ep in entry_points(group=PROBE_MODES_GROUP)
              if ep.name == "dataset_shards"}  # fmt: skip
    if not values:
        raise missing
    if len(values) > 1:
        raise ValueError(
            f"several {PROBE_MODES_GROUP!r} entry points claim 'dataset_shards': "
            f"{', '.join(sorted(values))}; uninstall all but one"
        )
    (entry,) = values.values()
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("koochak"):
            raise
        raise missing from None
    return getattr(module, entry.attr)


def _resolve(location: str | os.PathLike[str]) -> tuple[Store | None, Path | None]:
    """(store, root): store is None for a plain directory; root is None for a non-local store."""
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    if sep and scheme.lower() != "file":
        store = open_store(text)
        declared = capabilities_of(store).root
        root = Path(declared) if declared is not None else None
        if root is not None and not root.is_dir():
            raise FileNotFoundError(f"probe: {text} resolves to {root}, which is not a directory")
        return store, root
    local = capabilities_of(open_store(text)).root  # plain paths and file:// URIs: a LocalStore
    if local is None or not Path(local).is_dir():
        raise FileNotFoundError(
            f"probe: {local or text} is not a directory; pass an existing directory"
        )
    return None, Path(local)


def _host() -> str:
    return (
        "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40] or "host"
    )


def _shielded(call: Callable[[], None]) -> None:
    """Run cleanup with Ctrl-C ignored, so a second Ctrl-C cannot leave scratch files behind."""
    if threading.current_thread() is not threading.main_thread():
        call()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        call()
    finally:
        signal.signal(signal.SIGINT, previous)


def _cleanup(scratch_dir: Path | None, remote: Store | None) -> None:
    if scratch_dir is not None:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        if scratch_dir.exists():
            print(
                f"koochak-probe: could not remove {scratch_dir}; remove it by hand", file=sys.stderr
            )
    elif remote is not None:
        for info in remote.list(""):
            remote.delete(info.key)


def _store_checks(store: Store, prefix: str) -> list[Check]:
    """The semantics a non-local store checks about itself, under ``prefix``.

    A backend that can say more than the Store API shows (an S3 store: whether conditional
    writes are honoured) declares ``probe_checks`` and offers ``probe_checks(prefix)`` returning
    rows of ``Check`` fields.
    """
    if not capabilities_of(store).probe_checks:
        return []
    return [Check(**row) for row in store.probe_checks(prefix)]  # type: ignore[attr-defined]


class _Prefixed:
    """A view of a store under a key prefix (the probe's scratch area), with its settings.

    It declares what the store declares, less what a prefix would make wrong: its root moves
    down by the prefix, and the store's own checks and batch put are not offered through it.
    """

    def __init__(self, store: Store, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self.location = f"{store.location}/{prefix}"
        declared = capabilities_of(store)
        root = declared.root
        self._capabilities = StoreCapabilities(
            publish=declared.publish,
            root=os.path.join(root, prefix.rstrip("/")) if root is not None else None,
            read_settle_seconds=declared.read_settle_seconds,
            profile=declared.profile,
        )

    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def get(self, key, start=None, end=None):
        return self._store.get(self._prefix + key, start, end)

    def open(self, key):
        return self._store.open(self._prefix + key)

    def put(self, key, data, *, expected_size=None, expected_sha256=None):
        return self._store.put(
            self._prefix + key, data, expected_size=expected_size, expected_sha256=expected_sha256
        )

    def stat(self, key):
        return self._store.stat(self._prefix + key)

    def list(self, prefix=""):
        from dataclasses import replace

        n = len(self._prefix)
        return [replace(i, key=i.key[n:]) for i in self._store.list(self._prefix + prefix)]

    def delete(self, key):
        self._store.delete(self._prefix + key)

    def local_path(self, key):
        return self._store.local_path(self._prefix + key)


# -- output -------------------------------------------------------------------------------------


def _plain_float(value: float) -> str:
    # Positional notation: YAML 1.1 loaders read "1e-05" (no dot) as a string, not a number.
    text = f"{value:.12f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def profile_yaml(profile: StoreProfile) -> str:
    """The ``profile:`` block for the stores file."""
    return "\n".join(
        [
            "profile:",
            f"  request_seconds: {_plain_float(profile.request_seconds)}",
            f"  stream_bytes_per_second: {profile.stream_bytes_per_second:.0f}"
            f"  # {human_size(profile.stream_bytes_per_second)}/s",
            f"  concurrency: {profile.concurrency}",
            f"  range_reads_scale: {str(profile.range_reads_scale).lower()}",
            f"  part_bytes: {profile.part_bytes}  # {human_size(profile.part_bytes)}",
            f"  listing_cheap: {str(profile.listing_cheap).lower()}",
        ]
    )


def _value(row: Measurement) -> str:
    if row.unit == "s":
        return f"{row.value * 1e3:.2f} ms" if row.value < 1 else f"{row.value:.2f} s"
    return f"{human_size(row.value)}/s"


def format_report(report: ProbeReport) -> str:
    lines = [f"koochak-probe {report.location}", f"  scratch {report.scratch} (removed)", ""]
    if report.checks:
        lines.append("Semantics")
        width = max(len(check.name) for check in report.checks)
        for check in report.checks:
            verdict = {True: "yes", False: "no", None: "?"}[check.supported]
            lines.append(f"  {check.name:<{width}}  {verdict:<3}  {check.detail}")
        lines.append("")
    if report.settings is not None:
        unmeasured = any(c.supported is None and c.name in CROSS_CLIENT_CHECKS
                         for c in report.checks)  # fmt: skip
        lines.append(
            "Recommended LocalStore settings (cross-client semantics unmeasured: run --peer "
            "from a second node)"
            if unmeasured
            else "Recommended LocalStore settings"
        )
        for key, value in report.settings.items():
            shown = str(value).lower() if isinstance(value, bool) else value
            lines.append(f"  {key}: {shown}")
        lines.append("")
    if report.measurements:
        lines.append(f"Measurements (page cache dropped with: {report.cache_drop})")
        rows = [
            (row.metric, str(row.streams), _value(row), row.note) for row in report.measurements
        ]
        widths = [
            max(len(r[i]) for r in rows + [("metric", "streams", "value", "")]) for i in range(3)
        ]
        lines.append(
            f"  {'metric':<{widths[0]}}  {'streams':>{widths[1]}}  {'value':>{widths[2]}}  note"
        )
        for metric, n, value, note in rows:
            lines.append(f"  {metric:<{widths[0]}}  {n:>{widths[1]}}  {value:>{widths[2]}}  {note}")
        lines.append("")
    if report.profile is not None:
        lines.append("Recommended profile (paste under the scheme in the stores file)")
        lines += ["  " + line for line in profile_yaml(report.profile).splitlines()]
        lines.append("")
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines).rstrip() + "\n"


# -- command line -------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1 such as 1,4,16")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="koochak-probe",
        description="Check a filesystem's or store's semantics, measure it, and recommend "
        "LocalStore settings and a StoreProfile. Works in a scratch directory it removes.",
    )
    parser.add_argument("location", help="a directory, file:// URI or scheme:// store location")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--emit-profile",
        action="store_true",
        help="print only the recommended 'profile:' block for the stores file",
    )
    parser.add_argument(
        "--read-bytes",
        type=_size_arg,
        default=256 << 20,
        metavar="SIZE",
        help="bytes read per throughput measurement (default 256M)",
    )
    parser.add_argument(
        "--streams",
        type=_int_list,
        default=[1, 4, 16],
        metavar="N,N",
        help="parallel streams/ranges to try (default 1,4,16)",
    )
    parser.add_argument(
        "--small-objects",
        type=int,
        default=100,
        metavar="N",
        help="small objects for the latency figures (default 100)",
    )
    parser.add_argument(
        "--checkpoint-bytes",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="also write a checkpoint of SIZE bytes (e.g. 4G)",
    )
    parser.add_argument(
        "--checkpoint-parts",
        type=_int_list,
        default=[1, 8],
        metavar="N,N",
        help="concurrent parts for the checkpoint write (default 1,8)",
    )
    parser.add_argument(
        "--dataset-shards",
        type=int,
        default=None,
        metavar="N",
        help="also build N dataset shards and read them (needs koochak-data)",
    )
    parser.add_argument(
        "--shard-bytes",
        type=_size_arg,
        default=256 << 20,
        metavar="SIZE",
        help="bytes per dataset shard (default 256M)",
    )
    parser.add_argument(
        "--readers",
        type=_int_list,
        default=[1, 4, 16],
        metavar="N,N",
        help="reader processes for the dataset read (default 1,4,16)",
    )
    parser.add_argument(
        "--read-back-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for a closed file to read back (default 10)",
    )
    parser.add_argument(
        "--peer",
        default=None,
        metavar="PATH_OR_URI",
        help="another view of the same storage (another mount of the bucket, or a URI of it): "
        "also check what other clients see",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        metavar="N",
        help="repeat each timed check and throughput figure N times; advice uses medians (default 3)",
    )
    parser.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="never write /proc/sys/vm/drop_caches (per-file fadvise still runs)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return parser


def _stage_bar(args: argparse.Namespace):  # -> tqdm | None
    """A tqdm bar over the probe's stages on a terminal; None without tqdm (it is optional)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # semantics, [peer], small objects, reads, [checkpoint], [dataset], cleanup
    total = 4 + bool(args.peer) + bool(args.checkpoint_bytes) + bool(args.dataset_shards)
    return tqdm(total=total, unit="stage", leave=False)


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bar = _stage_bar(args) if sys.stderr.isatty() else None
    stage = None
    if bar is not None:

        def stage(message: str) -> None:
            bar.set_description_str(f"koochak-probe: {message}")
            bar.update(1)

    # A scheduler's SIGTERM must clean up like Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        report = probe(
            args.location,
            read_bytes=args.read_bytes,
            streams=args.streams,
            small_objects=args.small_objects,
            checkpoint_bytes=args.checkpoint_bytes,
            checkpoint_parts=args.checkpoint_parts,
            dataset_shards=args.dataset_shards,
            shard_bytes=args.shard_bytes,
            readers=args.readers,
            read_back_timeout=args.read_back_timeout,
            drop_caches=not args.no_drop_caches,
            stage=stage,
            peer=args.peer,
            rounds=args.rounds,
        )
    except KeyboardInterrupt:
        print("koochak-probe: interrupted; scratch directory removed", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"koochak-probe: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if bar is not None:
            bar.close()
    if args.emit_profile:
        if report.profile is None:
            print(
                "koochak-probe: no profile could be measured; see the full report", file=sys.stderr
            )
            return 1
        print(profile_yaml(report.profile))
    elif args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        sys.stdout.write(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

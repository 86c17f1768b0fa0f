"""The WebDataset tar layout: deterministic bytes, other readers agree, the strict reader refuses."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from koochak.data import _tar


def _archive(samples: list[dict]) -> bytes:
    chunks: list[bytes] = []
    for sample in samples:
        chunks.extend(_tar.encode_sample(sample))
    chunks.append(_tar.END_OF_ARCHIVE)
    return b"".join(chunks)


def _members(data: bytes, checksums: bool = True) -> list[tuple[str, bytes]]:
    return list(_tar.parse_members(memoryview(data), "t.tar", checksums=checksums))


def _read(data: bytes) -> list[dict]:
    return list(_tar.iter_samples(_members(data), "t.tar"))


SAMPLES = [
    {"__key__": "a/0001", "jpg": b"\xff\xd8" + bytes(700), "cls": b"3"},
    {"__key__": "a/0002", "seg.png": b"png!", "cls": b"", "json": b'{"x": 1}'},
    {"__key__": "b.dir/" + "k" * 80 + "/" + "z" * 30, "bin": bytes(range(256)) * 3},
]


def test_same_samples_give_identical_bytes() -> None:
    first = _archive(SAMPLES)
    # Field order in the dict must not matter: members are sorted per sample.
    reordered = [dict(reversed(list(s.items()))) for s in SAMPLES]
    assert _archive(reordered) == first
    assert len(first) % _tar.BLOCK == 0


def test_members_are_sorted_regular_files_with_fixed_headers() -> None:
    with tarfile.open(fileobj=io.BytesIO(_archive(SAMPLES))) as archive:
        members = archive.getmembers()
    assert [m.name for m in members[:2]] == ["a/0001.cls", "a/0001.jpg"]
    for member in members:
        assert member.isreg()
        assert (member.mode, member.uid, member.gid, member.mtime) == (0o644, 0, 0, 0)
        assert (member.uname, member.gname) == ("", "")
    assert members[-1].name == "b.dir/" + "k" * 80 + "/" + "z" * 30 + ".bin"  # ustar prefix split


def test_round_trip_through_our_reader() -> None:
    assert _read(_archive(SAMPLES)) == [
        {k: bytes(v) if k != "__key__" else v for k, v in s.items()} for s in SAMPLES
    ]


def test_webdataset_reads_our_samples(tmp_path) -> None:
    import webdataset as wds

    path = tmp_path / "shard-000000.tar"
    path.write_bytes(_archive(SAMPLES))
    got = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [g["__key__"] for g in got] == [s["__key__"] for s in SAMPLES]
    for sample, read in zip(SAMPLES, got):
        for field, value in sample.items():
            if field != "__key__":
                assert read[field] == value


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar program")
def test_gnu_tar_lists_and_extracts_our_archive(tmp_path) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(_archive(SAMPLES))
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(out)], check=True)
    assert (out / "a" / "0002.seg.png").read_bytes() == b"png!"


@pytest.mark.parametrize(
    "sample, message",
    [
        ({"jpg": b"x"}, "no '__key__'"),
        ({"__key__": "a"}, "no data fields"),
        ({"__key__": "a.b", "jpg": b"x"}, "must not contain '.'"),
        ({"__key__": "../a", "jpg": b"x"}, "'..'"),
        ({"__key__": "/a", "jpg": b"x"}, "relative"),
        ({"__key__": "a//b", "jpg": b"x"}, "empty"),
        ({"__key__": 3, "jpg": b"x"}, "must be a str"),
        ({"__key__": "a", "JPG": b"x"}, "lower-case"),
        ({"__key__": "a", "__url__": b"x"}, "lower-case"),
        ({"__key__": "a", "x/y": b"x"}, "lower-case"),
        ({"__key__": "a", "jpg": "text"}, "must be bytes"),
        ({"__key__": "a", "jpg": b"x", 3: b"y"}, "field names must be str"),
        ([("__key__", "a")], "must be a mapping"),
        ({"__key__": "a" * 300, "jpg": b"x"}, "too long"),
    ],
)
def test_bad_samples_are_refused(sample, message) -> None:
    with pytest.raises(ValueError, match=message):
        _tar.encode_sample(sample)


def _tarfile_archive(fmt: int, entries: list[tuple[str, bytes | None, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as archive:
        for name, data, kind in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            if data is not None:
                info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_reads_archives_from_tarfile_in_every_format(fmt) -> None:
    long_key = "d/" + "x" * 150 if fmt != tarfile.USTAR_FORMAT else "d/x"
    data = _tarfile_archive(
        fmt,
        [
            ("d", None, tarfile.DIRTYPE),
            (f"{long_key}.cls", b"7", tarfile.REGTYPE),
            (f"{long_key}.txt", "héllo".encode(), tarfile.REGTYPE),
            ("d/y.cls", b"8", tarfile.REGTYPE),
        ],
    )
    assert _read(data) == [
        {"__key__": long_key, "cls": b"7", "txt": "héllo".encode()},
        {"__key__": "d/y", "cls": b"8"},
    ]


@pytest.mark.parametrize(
    "name, kind, message",
    [
        ("a.lnk", tarfile.SYMTYPE, "symbolic link"),
        ("a.lnk", tarfile.LNKTYPE, "hard link"),
        ("a.dev", tarfile.CHRTYPE, "character device"),
        ("a.fifo", tarfile.FIFOTYPE, "FIFO"),
    ],
)
def test_links_and_devices_are_refused(name, kind, message) -> None:
    data = _tarfile_archive(tarfile.GNU_FORMAT, [(name, None, kind)])
    with pytest.raises(ValueError, match=message):
        _members(data)


@pytest.mark.parametrize("name", ["../evil.txt", "/etc/evil.txt", "a/../../evil.txt", "./a.txt"])
def test_unsafe_member_paths_are_refused(name) -> None:
    data = _tarfile_archive(tarfile.PAX_FORMAT, [(name, b"x", tarfile.REGTYPE)])
    with pytest.raises(ValueError, match="member name"):
        _members(data)


def test_member_without_extension_is_refused() -> None:
    data = _tarfile_archive(tarfile.USTAR_FORMAT, [("README", b"x", tarfile.REGTYPE)])
    with pytest.raises(ValueError, match="no '<key>.<extension>' name"):
        _read(data)


def test_non_contiguous_key_and_repeated_field_are_refused() -> None:
    split = _tarfile_archive(
        tarfile.USTAR_FORMAT,
        [("a.cls", b"1", tarfile.REGTYPE), ("b.cls", b"2", tarfile.REGTYPE), ("a.jpg", b"3", tarfile.REGTYPE)],
    )
    with pytest.raises(ValueError, match="appears twice"):
        _read(split)
    repeated = _tarfile_archive(
        tarfile.USTAR_FORMAT, [("a.cls", b"1", tarfile.REGTYPE), ("a.CLS", b"2", tarfile.REGTYPE)]
    )
    with pytest.raises(ValueError, match="field 'cls' twice"):
        _read(repeated)


def test_truncation_trailing_data_and_bad_checksum_are_refused() -> None:
    data = _archive(SAMPLES)
    with pytest.raises(ValueError, match="no end-of-archive"):
        _members(data[: -len(_tar.END_OF_ARCHIVE)])
    with pytest.raises(ValueError, match="member data at byte 1536 needs"):
        _members(data[:1600])
    with pytest.raises(ValueError, match="after the end-of-archive"):
        _members(data + b"junk" + bytes(508))
    corrupt = bytearray(data)
    corrupt[3] ^= 0x01  # inside the first member's name
    with pytest.raises(ValueError, match="checksum mismatch"):
        _members(bytes(corrupt))
    # Zero padding after the end marker (tar record blocking) is fine.
    assert _read(data + bytes(10240)) == _read(data)


_fields = st.dictionaries(
    st.from_regex(r"[a-z0-9][a-z0-9_]{0,6}(\.[a-z0-9]{1,4})?", fullmatch=True),
    st.binary(max_size=1500),
    min_size=1,
    max_size=4,
)
_keys = st.from_regex(r"[A-Za-z0-9_\-]{1,20}(/[A-Za-z0-9_\-]{1,20}){0,3}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_keys, _fields), max_size=6, unique_by=lambda kv: kv[0]))
def test_any_valid_samples_round_trip(pairs) -> None:
    samples = [{"__key__": key, **fields} for key, fields in pairs]
    assert _read(_archive(samples)) == samples


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096))
def test_fuzz_reader_only_raises_value_error(data) -> None:
    for checksums in (True, False):
        try:
            list(_tar.iter_samples(_members(data, checksums), "t.tar"))
        except ValueError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3071), st.binary(min_size=1, max_size=16))
def test_fuzz_corrupted_valid_archive_only_raises_value_error(offset, garbage) -> None:
    data = bytearray(_archive(SAMPLES[:2]))
    data[offset : offset + len(garbage)] = garbage
    for checksums in (True, False):
        try:
            for sample in _tar.iter_samples(_members(bytes(data), checksums), "t.tar"):
                assert isinstance(sample["__key__"], str)
        except ValueError:
            pass


def _general(data: bytes, copy: bool = False):
    """What the general parser makes of ``data``: its samples, or the ValueError it raises."""
    try:
        members = _tar.parse_members(memoryview(data), "t.tar", checksums=False)
        return [_plain(s) for s in _tar.iter_samples(members, "t.tar", copy=copy)]
    except ValueError as exc:
        return str(exc)


def _fused(data: bytes, copy: bool = False):
    try:
        parsed = _tar.parse_samples(memoryview(data), "t.tar", checksums=False, copy=copy)
        return [_plain(s) for s in parsed]
    except ValueError as exc:
        return str(exc)


def _plain(sample: dict) -> dict:
    return {k: (v if isinstance(v, str) else bytes(v)) for k, v in sample.items()}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_keys, _fields), max_size=6, unique_by=lambda kv: kv[0]), st.booleans())
def test_the_one_pass_parser_agrees_with_the_general_one(pairs, copy) -> None:
    samples = [{"__key__": key, **fields} for key, fields in pairs]
    data = _archive(samples)
    assert _fused(data, copy) == _general(data, copy) == samples
    if copy:
        parsed = _tar.parse_samples(memoryview(data), "t.tar", checksums=False, copy=True)
        assert all(isinstance(v, bytes) for s in parsed for k, v in s.items() if k != "__key__")


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3071), st.binary(min_size=1, max_size=16))
def test_the_one_pass_parser_accepts_and_refuses_what_the_general_one_does(offset, garbage):
    data = bytearray(_archive(SAMPLES[:2]))
    data[offset : offset + len(garbage)] = garbage
    assert _fused(bytes(data)) == _general(bytes(data))


def test_the_one_pass_parser_refuses_repeats_and_odd_names_like_the_general_one() -> None:
    a, b = _archive([{"__key__": "a", "x": b"1"}]), _archive([{"__key__": "b", "x": b"2"}])
    end = len(_tar.END_OF_ARCHIVE)
    again = a[:-end] + b[:-end] + a  # key "a" after "b": not contiguous
    assert "appears twice" in _fused(again) and _fused(again) == _general(again)
    twice = _archive([{"__key__": "a", "x": b"1"}])[:-end] * 2 + _tar.END_OF_ARCHIVE
    assert "twice" in _fused(twice) and _fused(twice) == _general(twice)
    upper = _archive([{"__key__": "k", "x": b"1"}]).replace(b"k.x\x00", b"k.X\x00", 1)
    assert _fused(upper) == _general(upper)  # (the header checksum is not checked here)

"""koochak-data pull loads only what it runs; koochak.data's public names still all import."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import koochak.data
import pytest
from koochak.data.archive import archive_tree

# What a pull never needs: the archiver, shards and packed streaming, the publication side of
# koochak.storage, and the heavy third-party stacks.
NOT_FOR_PULL = (
    "koochak.data.archive",
    "koochak.data.shards",
    "koochak.data.packed",
    "koochak.data.verify",
    "koochak.storage.artifact",
    "koochak.storage.publication",
    "koochak.storage.transfer",
    "boto3",
    "botocore",
    "torch",
    "numpy",
)


@pytest.mark.slow
def test_a_pull_through_the_cli_imports_nothing_it_does_not_run(tmp_path) -> None:
    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "a.txt").write_bytes(b"hello")
    archive_tree(tmp_path / "src", tmp_path / "coll", show_progress=False)
    code = (
        "import json, sys\n"
        "from koochak.data.cli import main\n"
        f"code = main(['pull', '--no-progress', {str(tmp_path / 'coll')!r}, "
        f"{str(tmp_path / 'out')!r}])\n"
        "print(json.dumps([code, sorted(sys.modules)]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    exit_code, modules = json.loads(result.stdout.splitlines()[-1])
    assert exit_code == 0 and (tmp_path / "out" / "d" / "a.txt").read_bytes() == b"hello"
    assert "koochak.data.pull" in modules  # it did run the pull
    loaded = [m for m in NOT_FOR_PULL if m in modules or any(n.startswith(m + ".") for n in modules)]
    assert not loaded, loaded


def test_every_public_name_of_koochak_data_is_the_object_of_its_module() -> None:
    homes = koochak.data._EXPORTS
    assert set(homes) == set(koochak.data.__all__)
    for name in koochak.data.__all__:
        home = importlib.import_module(f"koochak.data.{homes[name]}")
        assert getattr(koochak.data, name) is getattr(home, name), name
        assert name in dir(koochak.data)
    from koochak.data import FileEntry, pull_collection  # the from-import form too

    assert pull_collection.__module__ == "koochak.data.pull" and FileEntry.__name__ == "FileEntry"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        koochak.data.nope  # noqa: B018

"""The boundary check must pass on the real tree and fail on each kind of forbidden import."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_boundaries", ROOT / "tools" / "check_boundaries.py")
check_boundaries = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_boundaries", check_boundaries)
_spec.loader.exec_module(check_boundaries)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for sub in ("storage", "data", "events", "loop", "jobs", "s3"):
        dist = {"storage": "store", "s3": "store-s3"}.get(sub, sub)
        pkg = tmp_path / "packages" / f"koochak-{dist}" / "src" / "koochak" / sub
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_real_tree_passes():
    assert check_boundaries.check_tree(ROOT) == []


def test_allowed_imports_pass(tmp_path):
    root = _tree(tmp_path, {
        "packages/koochak-data/src/koochak/data/a.py": "from koochak.storage.store import open_store\n",
        "packages/koochak-loop/src/koochak/loop/a.py": "import torch\nimport koochak.events\n",
        "packages/koochak-data/src/koochak/data/b.py": "def f():\n    import torch\n",
        "packages/koochak-store-s3/src/koochak/s3/a.py": "from koochak.storage.store import Store\n",
    })
    assert check_boundaries.check_tree(root) == []


@pytest.mark.parametrize("rel, text, fragment", [
    ("packages/koochak-store/src/koochak/storage/a.py", "import koochak.data.shards\n",
     "koochak.storage may not import koochak.data"),
    ("packages/koochak-store/src/koochak/storage/a.py", "from koochak import loop\n",
     "may not import koochak.loop"),
    ("packages/koochak-data/src/koochak/data/a.py", "from ..loop import training_loop\n",
     "koochak.data may not import koochak.loop"),
    ("packages/koochak-events/src/koochak/events/a.py", "from koochak.storage import x\n",
     "koochak.events may not import koochak.storage"),
    ("packages/koochak-jobs/src/koochak/jobs/a.py", "import torch.nn as nn\n",
     "koochak.jobs is torch-free"),
    ("packages/koochak-data/src/koochak/data/a.py", "try:\n    import torch\nexcept ImportError:\n    pass\n",
     "koochak.data is torch-free"),
    ("packages/koochak-store/tests/test_x.py", "from koochak.data import shards\n",
     "koochak.storage may not import koochak.data"),
    ("packages/koochak-store/src/koochak/__init__.py", "", "PEP 420"),
    ("packages/koochak-store-s3/src/koochak/s3/a.py", "from koochak.data import shards\n",
     "koochak.s3 may not import koochak.data"),
    ("packages/koochak-store-s3/src/koochak/s3/a.py", "import torch\n", "koochak.s3 is torch-free"),
    ("packages/koochak-store/src/koochak/storage/a.py", "from koochak.s3 import S3Store\n",
     "koochak.storage may not import koochak.s3"),
    ("packages/koochak-data/src/koochak/data/a.py", "import koochak.s3\n",
     "koochak.data may not import koochak.s3"),
])
def test_forbidden_import_is_reported(tmp_path, rel, text, fragment):
    root = _tree(tmp_path, {rel: text})
    violations = check_boundaries.check_tree(root)
    assert any(fragment in str(v) for v in violations), violations
    assert check_boundaries.main([str(root)]) == 1


def test_type_checking_imports_are_ignored(tmp_path):
    root = _tree(tmp_path, {"packages/koochak-data/src/koochak/data/a.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n")})
    assert check_boundaries.check_tree(root) == []

"""koochak.storage must never import torch (checked in a clean interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_koochak_storage_and_every_submodule_does_not_import_torch():
    code = (
        "import importlib, pkgutil, sys\n"
        "import koochak.storage as s\n"
        "names = [m.name for m in pkgutil.iter_modules(s.__path__, 'koochak.storage.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "assert 'koochak.storage.store' in names and 'koochak.storage.testing' in names, names\n"
        "print(len(names))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr

"""koochak.jobs is importable on its own and stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources


def test_ships_type_information():
    assert resources.files("koochak.jobs").joinpath("py.typed").is_file()


def test_import_does_not_pull_in_torch():
    code = "import sys, koochak.jobs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_no_jobs_module_imports_torch_or_omegaconf_for_the_runner():
    code = (
        "import sys, pkgutil, importlib, koochak.jobs as j\n"
        "import koochak.jobs.runner\n"
        "runner_only = 'omegaconf' in sys.modules or 'yaml' in sys.modules\n"
        "for m in pkgutil.iter_modules(j.__path__):\n"
        "    importlib.import_module('koochak.jobs.' + m.name)\n"
        "print(runner_only, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], check=True, capture_output=True, text=True
    )
    assert out.stdout.split() == ["False", "False"]


def test_public_names_resolve():
    import koochak.jobs as jobs

    for name in jobs.__all__:
        assert getattr(jobs, name) is not None
    assert set(jobs.__all__) <= set(dir(jobs))

"""docs/migrating.md cannot go stale: every target in its tables imports (or, for a command,
is an installed console script or a module ``python -m`` can run).

The tables are parsed from the page itself: a row is ``| spec name | target, target |`` and each
backticked text in the right-hand cell is one target. Targets that other work is adding right now
are listed in PENDING and expected to fail until they land; remove an entry once it imports.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "migrating.md"

PENDING: set[str] = set()

_ROW = re.compile(r"^\|(?P<spec>[^|]+)\|(?P<here>[^|]+)\|\s*$")
_TICKED = re.compile(r"`([^`]+)`")


def parse_rows(text: str) -> list[tuple[str, list[str]]]:
    """``(spec cell, [targets])`` for every data row of every ``| spec | here |`` table."""
    rows = []
    in_table = False
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            in_table = False
            continue
        spec, here = match.group("spec").strip(), match.group("here").strip()
        if (spec, here) == ("spec", "here"):
            in_table = True
            continue
        if not in_table or set(spec) <= {"-", ":", " "}:
            continue
        rows.append((spec, _TICKED.findall(here)))
    return rows


def parse_removed(text: str) -> list[tuple[str, list[str]]]:
    """``(removed module, [what to import instead])`` for every row of the
    ``| removed | import instead |`` table."""
    rows = []
    in_table = False
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            in_table = False
            continue
        left, right = match.group("spec").strip(), match.group("here").strip()
        if (left, right) == ("removed", "import instead"):
            in_table = True
            continue
        if in_table and not set(left) <= {"-", ":", " "}:
            (module,) = _TICKED.findall(left)
            rows.append((module, _TICKED.findall(right)))
    return rows


ROWS = parse_rows(PAGE.read_text(encoding="utf-8"))
TARGETS = [target for _, targets in ROWS for target in targets]
REMOVED = parse_removed(PAGE.read_text(encoding="utf-8"))


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    # Never stop at the bare `koochak` namespace: every target names a subpackage or below.
    for cut in range(len(parts), min(2, len(parts)) - 1, -1):
        name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # this prefix is not a module; try a shorter one
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the name does not exist
        return obj
    raise ModuleNotFoundError(f"no module in {dotted!r}")


def _check_console_script(name: str) -> None:
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=name)
    assert callable(entry.load()), f"{name} -> {entry.value} is not callable"


def _check_runnable_module(name: str) -> None:
    spec = importlib.util.find_spec(name)
    assert spec is not None, f"python -m {name}: no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main_spec = importlib.util.find_spec(f"{name}.__main__")
        assert main_spec is not None, f"python -m {name}: the package has no __main__.py"
        source = Path(main_spec.origin).read_text(encoding="utf-8")
        assert "main(" in source, f"{main_spec.origin} does not call a main"
        return
    module = importlib.import_module(name)
    source = Path(spec.origin).read_text(encoding="utf-8")
    assert re.search(r"^if __name__ == .__main__.:", source, re.M), (
        f"python -m {name}: {spec.origin} has no __main__ block"
    )
    if hasattr(module, "main"):
        assert callable(module.main)


def check_target(target: str) -> None:
    if target.startswith("python -m "):
        if str(ROOT) not in sys.path:  # examples.* run from the repository root
            sys.path.insert(0, str(ROOT))
        _check_runnable_module(target[len("python -m ") :].split()[0])
    elif re.fullmatch(r"koochak-[a-z]+", target):
        _check_console_script(target)
    else:
        _resolve(target)


def test_the_page_has_tables_and_every_row_a_target():
    assert len(ROWS) > 100
    empty = [spec for spec, targets in ROWS if not targets]
    assert not empty, f"rows without a backticked target: {empty}"


def test_every_pending_entry_is_still_on_the_page():
    assert set(PENDING) <= set(TARGETS), sorted(set(PENDING) - set(TARGETS))


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(
            target,
            marks=pytest.mark.xfail(strict=False, reason="being built by other work")
            if target in PENDING
            else (),
        )
        for target in dict.fromkeys(TARGETS)
    ],
)
def test_target_exists(target):
    check_target(target)


def test_the_removed_module_paths_are_gone_and_their_names_are_mapped():
    removed = dict(REMOVED)
    # koochak-loop 0.4.0 removed the four 0.2 aliases its 0.3 warnings announced.
    assert set(removed) >= {"koochak.loop.checkpoint_format", "koochak.loop.publish",
                            "koochak.loop.resume", "koochak.loop.checkpoint_saver"}  # fmt: skip
    for module, instead in removed.items():
        sys.modules.pop(module, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
        assert instead, f"{module}: no name to import instead"
        for target in instead:
            check_target(target)


def test_the_entry_point_group_is_the_specs():
    from koochak.storage.store import ENTRY_POINT_GROUP

    assert ENTRY_POINT_GROUP == "koochak.stores"


def test_the_parser_sees_a_wrong_name():
    rows = parse_rows("| spec | here |\n|---|---|\n| `a.b` | `koochak.loop.config.nope` |\n")
    assert rows == [("`a.b`", ["koochak.loop.config.nope"])]
    with pytest.raises(AttributeError):
        check_target("koochak.loop.config.nope")
    with pytest.raises(ModuleNotFoundError):
        check_target("koochak.nowhere.thing")
    with pytest.raises(ValueError):
        check_target("koochak-nonexistent")

"""No two modules of one koochak subpackage import each other, directly or around a circle.

Every import statement counts, wherever it sits in the module (top level, ``if TYPE_CHECKING:``,
inside a function): a lazy import only hides a circle until the day someone moves it up. Read
with ``ast``, nothing is executed. Importing the subpackage itself (``from koochak.data import
_tar``) is not an edge: every submodule sits below its package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module_graph(package_dir: Path) -> dict[str, set[str]]:
    src_root = package_dir.parent.parent  # .../src
    names: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    package = ".".join(package_dir.relative_to(src_root).parts)
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if is_package else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                targets.add(module)
                targets.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in names and t not in (name, package)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def _subpackages() -> list[Path]:
    return sorted(p for p in ROOT.glob("packages/*/src/koochak/*") if (p / "__init__.py").exists())


def test_every_koochak_subpackage_is_found():
    names = {p.name for p in _subpackages()}
    assert {"storage", "data", "events", "loop", "jobs"} <= names, names


def test_no_import_cycles_inside_a_koochak_subpackage():
    problems = [
        " -> ".join(cycle)
        for package in _subpackages()
        for cycle in _cycles(_module_graph(package))
    ]
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_the_cycle_finder_sees_a_lazy_circle(tmp_path):
    package = tmp_path / "src" / "koochak" / "demo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from koochak.demo.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from . import a\n")
    (package / "c.py").write_text("from koochak.demo import a\nimport koochak.demo\n")
    assert _cycles(_module_graph(package)) == [
        ["koochak.demo.a", "koochak.demo.b", "koochak.demo.a"]
    ]

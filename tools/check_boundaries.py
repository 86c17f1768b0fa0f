#!/usr/bin/env python3
"""Fail when a Koochak distribution imports a package that design.md does not allow.

Reads every module with `ast` (nothing is executed) and checks two rules:

1. A distribution's source and tests import only the koochak subpackages it may depend on
   (lower layers never depend on higher ones, not even in their tests).
2. The torch-free subpackages never import torch at module level; inside a function is fine,
   because that is how an optional dependency is loaded only where it is used.

Usage: python tools/check_boundaries.py [REPO_ROOT]    (exit 1 and one line per violation)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# subpackage -> the koochak subpackages it may import (itself is always allowed)
ALLOWED: dict[str, frozenset[str]] = {
    "storage": frozenset(),
    "events": frozenset(),
    "data": frozenset({"storage"}),
    "loop": frozenset({"storage", "events"}),
    "jobs": frozenset({"storage", "events"}),
    # koochak-store-s3, a plugin store: it sees only the storage layer, and nothing imports it
    # (open_store finds it through its entry point).
    "s3": frozenset({"storage"}),
}
TORCH_FREE = frozenset({"storage", "data", "events", "jobs", "s3"})
HEAVY_MODULES = ("torch",)


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _module_name(path: Path, src_root: Path) -> str:
    parts = list(path.relative_to(src_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module named by a (possibly relative) `from ... import`."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(tree: ast.Module, module: str, is_package: bool):
    """Yield (absolute module, line, at_module_level) for every import in the tree."""

    def visit(node: ast.AST, top: bool):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, top
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(child, module, is_package)
                yield target, child.lineno, top
                if target == "koochak":  # `from koochak import storage`
                    for alias in child.names:
                        yield f"koochak.{alias.name}", child.lineno, top
            yield from visit(child, inner)

    yield from visit(tree, True)


def _is_type_checking_block(tree: ast.Module) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks, which never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = getattr(test, "id", None) or getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def check_file(path: Path, owner: str, module: str, *, source: bool) -> list[Violation]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = _is_type_checking_block(tree)
    allowed = ALLOWED[owner] | {owner}
    found: list[Violation] = []
    for target, line, top in _imports(tree, module, path.name == "__init__.py"):
        parts = target.split(".")
        if parts[0] == "koochak" and len(parts) > 1 and parts[1] not in allowed:
            found.append(
                Violation(path, line, f"koochak.{owner} may not import koochak.{parts[1]}"
                          f" (allowed: {', '.join(sorted(allowed))})")
            )
        if (source and owner in TORCH_FREE and top and parts[0] in HEAVY_MODULES
                and line not in type_only):
            found.append(
                Violation(path, line, f"koochak.{owner} is torch-free: import {parts[0]} "
                          "inside the function that needs it")
            )
    return found


def check_tree(root: Path) -> list[Violation]:
    violations: list[Violation] = []
    packages = sorted((root / "packages").glob("koochak-*"))
    if not packages:
        raise SystemExit(f"check_boundaries: no packages/koochak-* under {root}")
    for dist in packages:
        src_root = dist / "src"
        subs = [p.name for p in (src_root / "koochak").iterdir() if p.is_dir()] if (
            src_root / "koochak").is_dir() else []
        if (src_root / "koochak" / "__init__.py").exists():
            violations.append(Violation(src_root / "koochak" / "__init__.py", 1,
                                        "koochak is a PEP 420 namespace: remove this file"))
        for sub in subs:
            if sub not in ALLOWED:
                violations.append(Violation(src_root / "koochak" / sub, 0,
                                            f"unknown subpackage koochak.{sub} (see design.md)"))
                continue
            for path in sorted((src_root / "koochak" / sub).rglob("*.py")):
                module = _module_name(path, src_root)
                violations += check_file(path, sub, module, source=True)
            for path in sorted((dist / "tests").rglob("*.py")) if (dist / "tests").is_dir() else []:
                violations += check_file(path, sub, f"tests.{path.stem}", source=False)
    return violations


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    violations = check_tree(root)
    for v in violations:
        print(v)
    if violations:
        print(f"check_boundaries: {len(violations)} violation(s)", file=sys.stderr)
        return 1
    print("check_boundaries: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

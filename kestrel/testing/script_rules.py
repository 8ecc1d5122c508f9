"""The house rules of ``scripts/``, read from each file's syntax tree (docs/architecture.md):

* no script touches a private member: no ``x._name`` but on ``self`` / ``cls``, no import of a
  ``_name`` or from a ``_module``, no ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` of a
  ``"_name"``, bar the exact sites in :data:`PRIVATE_ACCESS` (third-party objects), each with its
  reason; an exemption no longer needed is itself a breach. Where a script needs something of
  the package, the package gives it a public name (a hook, a property), documented as such;
* every script with a ``main`` is named by a test: a string in ``tests/`` (not a docstring) that
  is its module name or its file name (``"bench_radix"``, ``"scripts/bench_radix.py"``); a
  script without a ``main`` (a shared module: ``harness``, ``timing``, ...) runs nothing on
  import.

Each check returns one readable line per breach, ``path:line scope: what``;
:func:`kestrel.testing.style_rules.style_breaches` gathers them with the other rules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PRIVATE_ACCESS", "PUBLIC_UNDERSCORED", "private_access", "scripts_without_test"]

PRIVATE_ACCESS = {
    "scripts/bench_reference.py: model._setup_caches": (
        "the public Moondream reference's own model (a vikhyat/moondream checkout, imported as it "
        "is, never copied): built with setup_caches=False, it allocates its KV caches here, a "
        "step its code names privately and gives no public call for"
    ),
}  # exact "path: expression" -> why a script may touch that private member
# namedtuple's public API is spelled with an underscore
PUBLIC_UNDERSCORED = frozenset({"_asdict", "_field_defaults", "_fields", "_make", "_replace"})


def sources(root: Path, folders: tuple[str, ...]) -> Iterator[tuple[str, ast.Module]]:
    """``(relative path, syntax tree)`` of every Python file under ``folders`` of ``root``
    (bar the generated ``tests/fixtures/``)."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not rel.startswith("tests/fixtures/"):
                yield rel, ast.parse(path.read_text(), rel)


def body(tree: ast.Module) -> list[ast.stmt]:
    """A module's statements after its docstring, if any."""
    first = tree.body[0] if tree.body else None
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return tree.body[1:] if doc and isinstance(first.value.value, str) else tree.body


def _private(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name not in PUBLIC_UNDERSCORED


def _private_uses(node: ast.AST) -> Iterator[str]:
    """What of ``node`` itself touches a private member, as source text."""
    if isinstance(node, ast.Attribute) and _private(node.attr):
        if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield ast.unparse(node)
    elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
        module = node.module or ""
        if any(_private(part) for part in module.split(".")):
            yield f"from {module} import ..."
        yield from (f"from {module} import {a.name}" for a in node.names if _private(a.name))
    elif isinstance(node, ast.Import):
        yield from (f"import {a.name}" for a in node.names if any(map(_private, a.name.split("."))))
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and _private(node.args[1].value)
    ):
        yield ast.unparse(node.func) + f"(..., {node.args[1].value!r})"


def _scoped(tree: ast.AST, scope: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every node under ``tree`` with the qualified name of the function or class around it."""
    for node in ast.iter_child_nodes(tree):
        yield scope, node
        named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        yield from _scoped(node, f"{scope}.{node.name}".lstrip(".") if named else scope)


def private_access(
    root: Path, folders: tuple[str, ...] = ("scripts",), exempt: dict[str, str] = PRIVATE_ACCESS
) -> list[str]:
    """Private members touched from ``folders`` (see the module doc), as ``path:line scope:
    expression``, and exemptions no longer needed."""
    out, seen = [], set()
    for rel, tree in sources(root, folders):
        for scope, node in _scoped(tree):
            for expr in _private_uses(node):
                seen.add(f"{rel}: {expr}")
                if f"{rel}: {expr}" not in exempt:
                    where = f"{rel}:{node.lineno} {scope or '<module>'}"
                    out.append(f"{where}: {expr} (a private member)")
    out += [f"{key}: exempted but not found (stale exemption)" for key in exempt if key not in seen]
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring constant under ``tree``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


# what a shared script module (no main) may hold at its top: it runs nothing on import
_DECLARATIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign,
                 ast.AnnAssign, ast.If, ast.Try)  # fmt: skip


def scripts_without_test(root: Path) -> list[str]:
    """Each ``scripts/*.py`` with a top-level ``main`` that no test names: no string constant
    in ``tests/`` (docstrings aside) is its module name, its file name or a path ending in it;
    and each without a ``main`` that runs code on import (a call or ``with`` at the top)."""
    names: set[str] = set()
    for _rel, tree in sources(root, ("tests",)):
        skip = _docstrings(tree)
        names.update(
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip
        )  # fmt: skip
    out = []
    for rel, tree in sources(root, ("scripts",)):
        if "/" in rel.removeprefix("scripts/"):
            continue
        main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"),
                    None)  # fmt: skip
        stem = Path(rel).stem
        if main is None:  # a shared module (harness, timing, ...)
            runs = [n for n in body(tree) if not isinstance(n, _DECLARATIONS)]
            if runs:
                out.append(f"{rel}:{runs[0].lineno}: runs code on import and has no main")
        elif not any(n in (stem, f"{stem}.py") or n.endswith(f"/{stem}.py") for n in names):
            out.append(f"{rel}:{main.lineno} main: no test names {stem!r} (run it, --smoke)")
    return out

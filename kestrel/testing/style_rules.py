"""The house rules read from each file's syntax tree, and the one read from a fresh import.

* one typing dialect: every module that holds code starts with ``from __future__ import
  annotations`` (after its docstring), and nothing takes ``Optional``, ``Union``, ``List``,
  ``Dict``, ``Tuple``, ``Set``, ``FrozenSet`` or ``Type`` from ``typing`` (``X | None`` and the
  builtin generics say the same);
* every ``@dataclass`` passes ``slots=True`` (values are frozen too, but state holders may not be);
* no function body -- its first statement after the docstring to its last line -- runs past
  :data:`MAX_FUNCTION_LINES` lines, bar the exact names in :data:`LONG_FUNCTIONS`, each with its
  reason; an exemption that is no longer needed is itself a breach;
* ``import kestrel`` and ``import kestrel_kernels`` in a fresh CPU-only interpreter load none of
  :data:`OPTIONAL_MODULES`: the modules only an optional extra installs, and the heavy parts of
  torch and of kestrel that wait until something asks for them;
* the scripts' two rules (:mod:`kestrel.testing.script_rules`): no script touches a private
  member, and every script with a ``main`` is named by a test.

Each check reads a tree at ``root`` (the repository's, or a copy of it) and returns one readable
line per breach, ``path:line name: what``: :func:`style_breaches` gathers them by rule for
``scripts/package_map.py`` and ``tests/unit/test_style_rules.py``.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kestrel.testing.script_rules import private_access, scripts_without_test

__all__ = [
    "EXTRA_MODULES",
    "LONG_FUNCTIONS",
    "MAX_FUNCTION_LINES",
    "OPTIONAL_MODULES",
    "STYLE_CHECKED",
    "TYPING_BANNED",
    "eager_imports",
    "extra_only_modules",
    "function_lengths",
    "long_functions",
    "style_breaches",
    "typing_dialect",
    "unslotted_dataclasses",
]

STYLE_CHECKED = ("kestrel", "kestrel_kernels", "scripts", "tests")  # the typing dialect
CODE_CHECKED = ("kestrel", "kestrel_kernels", "scripts")  # dataclasses and function lengths
TYPING_BANNED = frozenset(
    {"Optional", "Union", "List", "Dict", "Tuple", "Set", "FrozenSet", "Type"}
)
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS = {
    "kestrel_kernels/triton_decode.py: _build_split": (
        "its lines are one GPU kernel, the split-KV decode (a 56-line @triton.jit body under its "
        "signature): one online-softmax loop, read whole, whose sm_90 registers and spills "
        "(docs/kernels.md) were measured on it as it stands"
    ),
}  # exact "path: qualified name" -> why it may run past MAX_FUNCTION_LINES
# Each optional extra of pyproject.toml (by requirement name) -> the modules only it installs.
# tests/unit/test_style_rules.py fails when an extra's requirement is missing here or stale.
EXTRA_MODULES = {
    "huggingface_hub": ("huggingface_hub",),
    "starlette": ("starlette",),
    "uvicorn": ("uvicorn",),
    "prometheus-client": ("prometheus_client",),
    "ray": ("ray",),
    "llguidance": ("llguidance",),
    "jsonschema": ("jsonschema",),
    "matplotlib": ("matplotlib",),
    "triton": ("triton",),
    "flash-attn-4": ("flash_attn", "flash_attn_interface", "cutlass"),  # cutlass: its CuTe DSL
    "pytest": ("pytest",),
    "pytest-xdist": ("xdist",),
    "hypothesis": ("hypothesis",),
    "ruff": ("ruff",),
    "httpx": ("httpx",),
    "openai": ("openai",),
    "selenium": ("selenium",),
}
OPTIONAL_MODULES = (
    *sorted({m for mods in EXTRA_MODULES.values() for m in mods}),
    "torch._dynamo",  # torch.compile's tracer: loaded when something compiles
    "kestrel.server",  # the serve extra's HTTP front door
    "kestrel.distributed",  # the ray extra's front doors
    "kestrel.testing",  # fixture makers and these rules: tests and scripts only
)


def _sources(root: Path, folders: tuple[str, ...]) -> Iterator[tuple[str, ast.Module]]:
    """``(relative path, syntax tree)`` of every Python file under ``folders`` of ``root``."""
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith("tests/fixtures/"):  # generated data, outside ruff's reach too
                continue
            yield rel, ast.parse(path.read_text(), rel)


def _body(node: ast.Module | ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    """The statements after the docstring, if any."""
    body = node.body
    first = body[0] if body else None
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return body[1:] if doc and isinstance(first.value.value, str) else body


def _future_annotations(tree: ast.Module) -> bool:
    first = _body(tree)[0]
    return (
        isinstance(first, ast.ImportFrom)
        and first.module == "__future__"
        and any(a.name == "annotations" for a in first.names)
    )


def typing_dialect(root: Path, folders: tuple[str, ...] = STYLE_CHECKED) -> list[str]:
    """Modules with code that do not open with the future import; old ``typing`` generics."""
    out = []
    for rel, tree in _sources(root, folders):
        if _body(tree) and not _future_annotations(tree):
            line = _body(tree)[0].lineno
            out.append(f"{rel}:{line}: does not start with from __future__ import annotations")
        aliases = {"typing", "typing_extensions"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update(
                    a.asname or a.name for a in node.names if a.name in aliases
                )  # import typing as t
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
                for a in node.names:
                    if a.name in TYPING_BANNED:
                        out.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in TYPING_BANNED
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                out.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr == "dataclass"
    return isinstance(target, ast.Name) and target.id == "dataclass"


def _slotted(decorator: ast.expr) -> bool:
    return isinstance(decorator, ast.Call) and any(
        k.arg == "slots" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in decorator.keywords
    )


def unslotted_dataclasses(root: Path, folders: tuple[str, ...] = CODE_CHECKED) -> list[str]:
    """Every ``@dataclass`` that does not pass ``slots=True``, as ``path:line Class``."""
    return [
        f"{rel}:{node.lineno} {node.name}: @dataclass without slots=True"
        for rel, tree in _sources(root, folders)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for d in node.decorator_list
        if _is_dataclass(d) and not _slotted(d)
    ]


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef]]:
    """Every function in ``tree`` with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _measure(root: Path, folders: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``"path: qualified name"`` -> (body lines, def line); a name defined twice in one file
    (a function under ``if`` / ``else``) keeps its longest."""
    out: dict[str, tuple[int, int]] = {}
    for rel, tree in _sources(root, folders):
        for name, fn in _functions(tree):
            body = _body(fn) or fn.body
            found = (fn.end_lineno - body[0].lineno + 1, fn.lineno)
            out[f"{rel}: {name}"] = max(found, out.get(f"{rel}: {name}", found))
    return out


def function_lengths(root: Path, folders: tuple[str, ...] = CODE_CHECKED) -> dict[str, int]:
    """``"path: qualified name"`` -> body lines (first statement after the docstring to the end)."""
    return {key: n for key, (n, _) in _measure(root, folders).items()}


def long_functions(
    root: Path,
    max_lines: int = MAX_FUNCTION_LINES,
    exempt: dict[str, str] = LONG_FUNCTIONS,
    folders: tuple[str, ...] = CODE_CHECKED,
) -> list[str]:
    """Functions over ``max_lines`` not exempted, and exemptions no longer needed."""
    found = _measure(root, folders)
    out = [
        f"{key.replace(': ', f':{line} ', 1)}: {n} lines"
        for key, (n, line) in sorted(found.items())
        if n > max_lines and key not in exempt
    ]
    for key in sorted(exempt):
        if key not in found:
            out.append(f"{key}: exempted but no such function (stale exemption)")
        elif found[key][0] <= max_lines:
            out.append(f"{key}: exempted but {found[key][0]} lines (stale exemption)")
    return out


def eager_imports(
    root: Path,
    packages: tuple[str, ...] = ("kestrel", "kestrel_kernels"),
    forbidden: tuple[str, ...] = OPTIONAL_MODULES,
) -> list[str]:
    """What of ``forbidden`` a fresh CPU-only ``import`` of ``packages`` from ``root`` loads."""
    code = (
        "import sys\n"
        f"for p in {packages!r}:\n"
        "    m = __import__(p)\n"
        f"    assert m.__file__.startswith({str(root.resolve())!r}), m.__file__\n"
        f"print('\\n'.join(m for m in {forbidden!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(root.resolve())}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=root,
        check=False,
    )
    if done.returncode != 0:
        return [f"import {', '.join(packages)} failed: {done.stderr.strip()[-2000:]}"]
    return [f"import {', '.join(packages)} loads {m}" for m in done.stdout.split()]


def _reachable(requirements: list[str]) -> set[str]:
    """The installed distributions ``requirements`` pull in, their extras' included."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            needs = md.distribution(key[0]).requires or ()
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, needs):
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(r)
    return {name for name, _ in seen}


def extra_only_modules(root: Path) -> set[str]:
    """Every installed top-level module that only the optional extras of ``root``'s
    pyproject.toml bring in, directly or through their own dependencies (Python 3.11+)."""
    import tomllib
    from packaging.utils import canonicalize_name

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    only = _reachable(extras) - _reachable(project["dependencies"])
    return {
        m
        for m, dists in md.packages_distributions().items()
        if m.isidentifier() and all(canonicalize_name(d) in only for d in dists)
    }


def style_breaches(root: Path, imports: bool = True) -> dict[str, list[str]]:
    """Every broken rule of this module, by rule (an empty list: the rule holds)."""
    out = {
        "modules off the typing dialect": typing_dialect(root),
        "dataclasses without slots": unslotted_dataclasses(root),
        f"functions over {MAX_FUNCTION_LINES} lines": long_functions(root),
        "private members touched by scripts": private_access(root),
        "scripts run by no test": scripts_without_test(root),
    }
    if imports:
        out["optional modules loaded by import kestrel"] = eager_imports(root)
    return out

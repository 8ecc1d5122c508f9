"""The house rules read from the code's imports: units, layers, and what breaks the rules.

Every ``import`` / ``from ... import`` in ``kestrel/`` and ``kestrel_kernels/`` counts, type-only
ones (under ``if TYPE_CHECKING:``) and function-local ones included. A unit is a sub-package
(``kestrel/runtime/``) or a module at the package root (``kestrel/tokens.py``); a unit's layer is
one above the highest unit it imports. ``from pkg import name`` where ``name`` is a submodule
counts as importing that submodule alone, as ``import pkg.name`` does.

Beyond the layers: the model (``kestrel/moondream``) imports only itself, the tokens and the
kernels; the image wing (``kestrel/crops``) only itself, the model, the images and the
kernels; the runtime, the wing and the model stand in that order, each on a higher layer than
the next (``ORDER``); and no module loads another from its file (``PATH_LOADS``), an import
no reading of the imports could see.

:func:`read_house` measures a tree (the repository's, or a copy of it); :func:`breaches` lists
every broken rule as one readable line each: ``scripts/package_map.py`` prints them and
``tests/unit/test_layers.py`` fails on them.
"""

from __future__ import annotations

import ast
import itertools
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CROPS",
    "CROPS_MAY_USE",
    "MAX_LINES",
    "MODEL",
    "MODEL_MAY_USE",
    "ORDER",
    "PATH_LOADS",
    "ROOT_MODULES",
    "TESTING",
    "House",
    "breaches",
    "copy_sources",
    "file_circles",
    "imported_modules",
    "layers",
    "read_house",
]

PACKAGES = ("kestrel", "kestrel_kernels")
MODEL = "kestrel/moondream"
MODEL_MAY_USE = frozenset({"kestrel/moondream", "kestrel/tokens.py", "kestrel_kernels"})
CROPS = "kestrel/crops"  # the image wing: a decoded image -> the vision encoder's input
CROPS_MAY_USE = frozenset({CROPS, MODEL, "kestrel/images", "kestrel_kernels"})
ORDER = ("kestrel/runtime", CROPS, MODEL)  # each unit strictly above the next
# calls that load a module from a file (unseen by an import reading): none in the packages
PATH_LOADS = frozenset({"spec_from_file_location", "run_path", "SourceFileLoader"})
TESTING = "kestrel/testing"  # fixture makers and these rules: for tests and scripts only
ROOT_MODULES = frozenset({
    "kestrel/__init__.py", "kestrel/__main__.py", "kestrel/errors.py",
    "kestrel/results.py", "kestrel/tokens.py",
})  # fmt: skip
MAX_LINES = 400
LINE_CHECKED = ("kestrel", "kestrel_kernels", "scripts")  # every source folder but tests/


@dataclass(frozen=True, slots=True)
class House:
    """One reading of a tree: each module's file, imports, unit and lines; the unit graph."""

    root: Path
    modules: dict[str, Path]  # dotted name -> file
    imports: dict[str, set[str]]  # module -> the package modules it imports
    unit: dict[str, str]  # module -> its unit
    lines: dict[str, int]  # module -> its lines
    units: dict[str, set[str]]  # unit -> the units it imports

    def layer(self) -> dict[str, int]:
        return layers(self.units)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` (module ``name``) imports."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{a.name}" for a in node.names}
            found.update(subs)
            if not subs <= modules.keys():  # a name defined (or re-exported) by ``base``
                found.add(base)
    return {m for m in found if m in modules and m != name}


def unit_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    if rel.parts[0] == "kestrel_kernels":
        return "kestrel_kernels"
    return rel.as_posix() if len(rel.parts) == 2 else "/".join(rel.parts[:2])


def file_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layers(units: dict[str, set[str]]) -> dict[str, int]:
    """Longest-path layer of each unit over the unit graph (cycles broken by first visit)."""
    layer: dict[str, int] = {}
    busy: set[str] = set()

    def depth(u: str) -> int:
        if u in layer:
            return layer[u]
        if u in busy:
            return 0
        busy.add(u)
        layer[u] = 1 + max((depth(v) for v in sorted(units.get(u, ())) if v != u), default=0)
        return layer[u]

    for u in sorted(units):  # sorted: a circle is broken in the same place on every run
        depth(u)
    return layer


def read_house(root: Path) -> House:
    """Measure the packages of the tree at ``root``."""
    modules = module_files(root)
    imports = {name: imported_modules(path, name, modules) for name, path in modules.items()}
    unit = {name: unit_of(path, root) for name, path in modules.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    # a package's __init__ is its face: it re-exports its own files, which is no arrow
    units: dict[str, set[str]] = defaultdict(set)
    for name, deps in imports.items():
        units[unit[name]].update(unit[d] for d in deps if unit[d] != unit[name])
    units.pop("kestrel/__init__.py", None)
    for deps in units.values():
        deps.discard("kestrel/__init__.py")
    return House(root, modules, imports, unit, lines, dict(units))


def _offending(house: House, source_unit: str, target_unit: str) -> list[str]:
    """The imports behind one unit arrow, as ``module -> module``."""
    return [
        f"{m} -> {d}"
        for m in sorted(house.imports)
        if house.unit[m] == source_unit
        for d in sorted(house.imports[m])
        if house.unit[d] == target_unit
    ]


def back_arrows(house: House) -> list[str]:
    layer = house.layer()
    return [
        f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]}): "
        + ", ".join(_offending(house, a, b))
        for a, deps in sorted(house.units.items())
        for b in sorted(deps)
        if layer[b] >= layer[a]
    ]


def circles(house: House) -> list[list[str]]:
    return file_circles({m: set(deps) for m, deps in house.imports.items()})


def root_modules(house: House) -> set[str]:
    return {u for u in house.unit.values() if u.endswith(".py")} | {"kestrel/__init__.py"}


def long_files(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Python files outside tests/ over ``max_lines`` lines, as ``path: lines``."""
    out = []
    for folder in LINE_CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > max_lines:
                out.append(f"{path.relative_to(root).as_posix()}: {n} lines")
    return out


def _uses_beyond(house: House, unit: str, allowed: frozenset[str]) -> list[str]:
    """Imports from ``unit`` to any unit outside ``allowed``."""
    return [
        f"{m} -> {d}"
        for m in sorted(house.imports)
        if house.unit[m] == unit
        for d in sorted(house.imports[m])
        if house.unit[d] not in allowed
    ]


def model_uses(house: House) -> list[str]:
    """Imports from the model package to anything but itself, the tokens and the kernels."""
    return _uses_beyond(house, MODEL, MODEL_MAY_USE)


def crops_uses(house: House) -> list[str]:
    """Imports from the image wing to anything but itself, the model, the images and the
    kernels (above all, nothing of the runtime that asks it for crops)."""
    return _uses_beyond(house, CROPS, CROPS_MAY_USE)


def out_of_order(house: House) -> list[str]:
    """Each pair of ``ORDER`` whose first unit is not on a higher layer than the second, or
    is reached from it (the second imports the first, through any chain: on a circle the
    layers depend on where it was broken, so the reach decides)."""
    layer = house.layer()
    return [
        f"{a} (layer {layer.get(a)}) is not above {b} (layer {layer.get(b)})"
        for a, b in itertools.pairwise(ORDER)
        if a not in layer or b not in layer or layer[a] <= layer[b] or _reaches(house, b, a)
    ]


def _reaches(house: House, start: str, goal: str) -> bool:
    """Whether unit ``start`` imports unit ``goal``, directly or through other units."""
    seen, todo = {start}, [start]
    while todo:
        for v in house.units.get(todo.pop(), ()):
            if v == goal:
                return True
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return False


def path_loads(house: House) -> list[str]:
    """Calls (or mentions) of ``PATH_LOADS`` in the packages, as ``path:line name``: a module
    loaded from its file is an import these rules cannot read."""
    out = []
    for name in sorted(house.modules):
        path = house.modules[name]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found = getattr(node, "attr", None) or getattr(node, "id", None)
            if isinstance(node, ast.alias):
                found = node.name.rsplit(".", 1)[-1]
            if found in PATH_LOADS:
                out.append(f"{path.relative_to(house.root).as_posix()}:{node.lineno} {found}")
    return out


def testing_users(house: House) -> list[str]:
    """Imports of the testing room from any other part of the packages."""
    return [
        f"{m} -> {d}"
        for m in sorted(house.imports)
        if house.unit[m] != TESTING
        for d in sorted(house.imports[m])
        if house.unit[d] == TESTING
    ]


def breaches(house: House) -> dict[str, list[str]]:
    """Every broken house rule, by rule (an empty list: the rule holds)."""
    roots = root_modules(house)
    return {
        "imports running back up": back_arrows(house),
        "import circles between files": [" -> ".join(c) for c in circles(house)],
        "root modules beyond the listed ones": sorted(roots - ROOT_MODULES),
        f"files over {MAX_LINES} lines outside tests/": long_files(house.root),
        "model package imports beyond itself, tokens and kernels": model_uses(house),
        "image wing imports beyond itself, the model, images and kernels": crops_uses(house),
        "runtime, image wing and model out of layer order": out_of_order(house),
        "modules loaded by their file path": path_loads(house),
        "imports of the testing room from the packages": testing_users(house),
    }


SOURCES = ("kestrel", "kestrel_kernels", "scripts")


def copy_sources(root: Path, dest: Path, folders: tuple[str, ...] = SOURCES) -> Path:
    """The Python files of ``folders`` under ``root`` copied under ``dest`` (returned): a tree
    the rule tests plant breaches in."""
    for folder in folders:
        shutil.copytree(
            root / folder,
            dest / folder,
            ignore=lambda d, names: [
                n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()
            ],
        )
    return dest

"""The package's structure read from its imports: folders as units, layers, and the rules.

    python scripts/package_map.py [--png docs/package_map.png]

Every ``import`` / ``from ... import`` in ``kestrel/`` and ``kestrel_kernels/`` counts, type-only
ones (under ``if TYPE_CHECKING:``) and function-local ones included. A unit is a sub-package
(``kestrel/runtime/``) or a module at the package root (``kestrel/images.py``); a unit's layer is
one above the highest unit it imports. Prints each unit with its files, lines and layer, then
the figures the house rules are about: imports that run back up (to a unit on the same or a
higher layer), import circles between files, the number of root modules, and what the model
package imports. With ``--png``, draws the units by layer with their imports (matplotlib).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kestrel", "kestrel_kernels")
MODEL = "kestrel/moondream"
MODEL_MAY_USE = {"kestrel/moondream", "kestrel/tokens.py", "kestrel_kernels"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (a ``from pkg import name`` of a submodule
    counts as that submodule)."""
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
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules and m != name}


def unit_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "kestrel_kernels":
        return "kestrel_kernels"
    return rel.as_posix() if len(rel.parts) == 2 else "/".join(rel.parts[:2])


def file_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative enough here)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
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
        layer[u] = 1 + max((depth(v) for v in units[u] if v != u), default=0)
        return layer[u]

    for u in units:
        depth(u)
    return layer


def analyse():
    modules = module_files()
    files = {name: imported_modules(path, name, modules) for name, path in modules.items()}
    unit = {name: unit_of(path) for name, path in modules.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    # a package's __init__ is its face: it re-exports its own files, which is no arrow
    units: dict[str, set[str]] = defaultdict(set)
    for name, deps in files.items():
        units[unit[name]].update(unit[d] for d in deps if unit[d] != unit[name])
    units.pop("kestrel/__init__.py", None)
    for deps in units.values():
        deps.discard("kestrel/__init__.py")
    return modules, files, unit, lines, dict(units)


def report(modules, files, unit, lines, units) -> dict[str, int]:
    layer = layers(units)
    per_unit: dict[str, list[str]] = defaultdict(list)
    for name in modules:
        per_unit[unit[name]].append(name)
    print(f"{'layer':>5}  {'unit':<28} {'files':>5} {'lines':>6}  imports")
    for u in sorted(layer, key=lambda u: (-layer[u], u)):
        total = sum(lines[m] for m in per_unit[u])
        deps = ", ".join(sorted(units[u]))
        print(f"{layer[u]:>5}  {u:<28} {len(per_unit[u]):>5} {total:>6}  {deps}")
    back = [(a, b) for a, deps in units.items() for b in deps if layer[b] >= layer[a]]
    file_graph = {m: {d for d in deps if d != m} for m, deps in files.items()}
    circles = file_circles(file_graph)
    roots = [u for u in per_unit if u.endswith(".py")] + ["kestrel/__init__.py"]
    model_uses = {
        unit[d] for m in modules if unit[m] == MODEL for d in files[m] if unit[d] != MODEL
    } - MODEL_MAY_USE
    print()
    print(f"units: {len(layer)}; layers: {max(layer.values())}")
    print(f"imports running back up: {len(back)} {back if back else ''}")
    print(f"import circles between files: {len(circles)} {circles if circles else ''}")
    print(f"modules at the package root: {len(set(roots))} ({', '.join(sorted(set(roots)))})")
    print(f"what the model package imports beyond itself, tokens and kernels: {model_uses or '-'}")
    return layer


def draw(units: dict[str, set[str]], layer: dict[str, int], lines, unit, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size: dict[str, int] = defaultdict(int)
    for name, n in lines.items():
        size[unit[name]] += n
    rows: dict[int, list[str]] = defaultdict(list)
    for u in sorted(layer, key=lambda u: (layer[u], u)):
        rows[layer[u]].append(u)
    pos = {}
    for lvl, us in rows.items():
        for i, u in enumerate(us):
            pos[u] = ((i + 0.5) / len(us), lvl)
    fig, ax = plt.subplots(figsize=(13, 1.1 * max(rows) + 1))
    for a, deps in units.items():
        for b in deps:
            (x0, y0), (x1, y1) = pos[a], pos[b]
            ax.annotate(
                "", (x1, y1 + 0.18), (x0, y0 - 0.18),
                arrowprops={"arrowstyle": "->", "color": "#9aa", "lw": 0.7},
            )  # fmt: skip
    for u, (x, y) in pos.items():
        label = u.removeprefix("kestrel/") if u != "kestrel_kernels" else u
        ax.text(
            x, y, f"{label}\n{size[u]:,} lines", ha="center", va="center", fontsize=8,
            bbox={"boxstyle": "round", "fc": "#eef4fb" if u.endswith(".py") else "#fdf3e1"},
        )  # fmt: skip
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(0.4, max(rows) + 0.6)
    ax.set_yticks(sorted(rows))
    ax.set_ylabel("layer (imports point down)")
    ax.set_xticks([])
    ax.set_title("kestrel: packages (orange) and root modules (blue) by layer; arrows = imports")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--png", type=Path, default=None, help="draw the map into this PNG")
    args = p.parse_args()
    modules, files, unit, lines, units = analyse()
    layer = report(modules, files, unit, lines, units)
    if args.png:
        draw(units, layer, lines, unit, args.png)


if __name__ == "__main__":
    main()

"""The package's structure read from its imports: folders as units, layers, and the rules.

    python scripts/package_map.py [--png docs/package_map.png]
    python scripts/package_map.py --smoke [--png PATH]   # the layers' rules only

The reading and the rules live in :mod:`kestrel.testing.layers` (``tests/unit/test_layers.py``
fails on any broken rule). Prints each unit with its files, lines and layer, then the figures
the house rules are about: imports that run back up (to a unit on the same or a higher layer),
import circles between files, the modules at the package root, files over 400 lines, what the
model package imports, and who imports the testing room; then, from
:mod:`kestrel.testing.style_rules` (``tests/unit/test_style_rules.py``), the longest functions,
modules off the typing dialect, dataclasses without slots, functions over 60 lines, and the
optional modules a fresh ``import kestrel`` loads. With ``--png``, draws the units by layer
with their imports (matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel.testing.layers import House, breaches, read_house, root_modules  # noqa: E402
from kestrel.testing.style_rules import (  # noqa: E402
    LONG_FUNCTIONS,
    MAX_FUNCTION_LINES,
    function_lengths,
    style_breaches,
)


def report(house: House, style: bool = True) -> dict[str, int]:
    """Print the units by layer and every rule's figure (``style``: the style rules' too);
    returns the layers."""
    layer = house.layer()
    per_unit: dict[str, list[str]] = defaultdict(list)
    for name in house.modules:
        per_unit[house.unit[name]].append(name)
    print(f"{'layer':>5}  {'unit':<28} {'files':>5} {'lines':>6}  imports")
    for u in sorted(layer, key=lambda u: (-layer[u], u)):
        total = sum(house.lines[m] for m in per_unit[u])
        deps = ", ".join(sorted(house.units[u]))
        print(f"{layer[u]:>5}  {u:<28} {len(per_unit[u]):>5} {total:>6}  {deps}")
    print()
    print(f"units: {len(layer)}; layers: {max(layer.values())}")
    roots = sorted(root_modules(house))
    print(f"modules at the package root: {len(roots)} ({', '.join(roots)})")
    rules = breaches(house)
    if style:
        longest = sorted(function_lengths(house.root).items(), key=lambda kv: -kv[1])
        print(f"longest functions (limit {MAX_FUNCTION_LINES} lines, exempted: *):")
        for name, n in longest[:5]:
            print(f"    {n:>4}  {name}{' *' if name in LONG_FUNCTIONS else ''}")
        rules |= style_breaches(house.root)
    for rule, found in rules.items():
        print(f"{rule}: {len(found)}")
        for line in found:
            print(f"    {line}")
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--png", type=Path, default=None, help="draw the map into this PNG")
    p.add_argument("--smoke", action="store_true",
                   help="the layers' rules only (test_style_rules.py runs the rest)")  # fmt: skip
    args = p.parse_args(argv)
    house = read_house(ROOT)
    layer = report(house, style=not args.smoke)
    if args.png:
        draw(house.units, layer, house.lines, house.unit, args.png)


if __name__ == "__main__":
    main()

"""``kestrel point IMAGE OBJECT``: the centre point of each instance of an object."""

from __future__ import annotations

import argparse

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    common.add_region_command(
        subparsers,
        "point",
        help="point at each instance of an object",
        description="Print one 'x=... y=...' line per instance of OBJECT (coordinates in [0, 1]).",
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    result = common.run_region_command(args, "point")
    if args.json:
        common.print_json(common.result_to_dict(result))
    else:
        for p in result.points:
            print(f"x={p['x']:.4f} y={p['y']:.4f}")
        common.note_if_empty(result.points, args.object)
    return 0

"""``kestrel detect IMAGE OBJECT``: a bounding box per instance of an object."""

from __future__ import annotations

import argparse

from . import common

_KEYS = ("x_min", "y_min", "x_max", "y_max")


def register(subparsers: argparse._SubParsersAction) -> None:
    common.add_region_command(
        subparsers,
        "detect",
        help="detect each instance of an object (bounding boxes)",
        description="Print one 'x_min=... y_min=... x_max=... y_max=...' line per instance of "
        "OBJECT (coordinates in [0, 1]).",
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    result = common.run_region_command(args, "detect")
    if args.json:
        common.print_json(common.result_to_dict(result))
    else:
        for box in result.objects:
            print(" ".join(f"{k}={box[k]:.4f}" for k in _KEYS))
        common.note_if_empty(result.objects, args.object)
    return 0

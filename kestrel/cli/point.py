"""``kestrel point IMAGE OBJECT``: the centre point of each instance of an object."""

from __future__ import annotations

import argparse

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    common.add_region_command(
        subparsers, "point", _line, help="point at each instance of an object",
        description="Print one 'x=... y=...' line per instance of OBJECT (coordinates in [0, 1]).",
    )  # fmt: skip


def _line(point: dict) -> str:
    return f"x={point['x']:.4f} y={point['y']:.4f}"

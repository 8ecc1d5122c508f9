"""``kestrel detect IMAGE OBJECT``: a bounding box per instance of an object."""

from __future__ import annotations

import argparse

from . import common

_KEYS = ("x_min", "y_min", "x_max", "y_max")


def register(subparsers: argparse._SubParsersAction) -> None:
    common.add_region_command(
        subparsers, "detect", _line, help="detect each instance of an object (bounding boxes)",
        description="Print one 'x_min=... y_min=... x_max=... y_max=...' line per instance of "
        "OBJECT (coordinates in [0, 1]).",
    )  # fmt: skip


def _line(box: dict) -> str:
    return " ".join(f"{k}={box[k]:.4f}" for k in _KEYS)

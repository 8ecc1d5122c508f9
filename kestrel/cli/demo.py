"""``kestrel demo``: the bundled model answers questions about the bundled sample scenes."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = common.add_command(
        subparsers, "demo", run, help="answer questions about the bundled sample scenes",
        description=(
            "Batch image-QA over the sample scenes shipped with Kestrel: questions, captions, "
            "points and boxes through the Engine, a PNG with the points and boxes drawn, and "
            "a cache summary. Runs on the embedded kestrel-tiny model by default."
        ),
    )  # fmt: skip
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("kestrel-demo.png"),
        help="where to write the PNG (default: ./kestrel-demo.png)",
    )
    common.add_engine_options(parser)
    parser.set_defaults(adapter=None)


def run(args: argparse.Namespace) -> int:
    from kestrel.tiny.demo import run_demo

    with common.open_engine(args) as engine:
        s = run_demo(engine, args.out)
    print(
        f"\n{s.correct}/{s.graded} answers right; {s.requests} requests in {s.wall_s:.2f} s "
        f"({s.requests_per_s:.1f} requests/s)\n"
        f"cache: hit rate {s.hit_rate:.1%}, prefill tokens saved {s.prefill_tokens_saved:,}, "
        f"vision encodes skipped {s.vision_encodes_skipped}\n"
        f"points and boxes drawn in {s.png}"
    )
    return 0

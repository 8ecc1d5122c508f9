"""``kestrel query IMAGE QUESTION``: ask one question about one image."""

from __future__ import annotations

import argparse
import sys

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "query",
        help="answer a question about an image",
        description="Answer a question about an image. IMAGE may be '-' to read it from stdin.",
    )
    parser.add_argument("image", metavar="IMAGE")
    parser.add_argument("question", metavar="QUESTION")
    parser.add_argument("--reasoning", action="store_true", help="think before answering")
    common.add_output_options(parser)
    common.add_engine_options(parser)
    common.add_generation_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    common.check_image_arg(args.image)
    image = common.read_image_arg(args.image)
    with common.open_engine(args) as engine:
        kwargs = {
            "settings": common.settings_from_args(args),
            "adapter": common.adapter_name(args),
            "reasoning": args.reasoning,
        }
        if args.stream:
            result = common.print_stream(engine.query(image, args.question, stream=True, **kwargs))
        else:
            result = engine.query(image, args.question, **kwargs)
    if args.json:
        common.print_json(common.result_to_dict(result))
        return 0
    if result.reasoning is not None:
        print(f"[reasoning] {result.reasoning.text}", file=sys.stderr)
    if not args.stream:
        print(result.answer)
    return 0

"""``kestrel caption IMAGE``: describe one image."""

from __future__ import annotations

import argparse

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = common.add_command(
        subparsers, "caption", run, "IMAGE", help="describe an image",
        description="Describe an image. IMAGE may be '-' to read it from stdin.",
    )  # fmt: skip
    parser.add_argument("--length", choices=("short", "normal", "long"), default="normal")
    common.add_output_options(parser)
    common.add_engine_options(parser)
    common.add_generation_options(parser)


def run(args: argparse.Namespace) -> int:
    common.check_image_arg(args.image)
    image = common.read_image_arg(args.image)
    kwargs = {
        "length": args.length,
        "settings": common.settings_from_args(args),
        "adapter": common.adapter_name(args),
    }
    with common.open_engine(args) as engine:
        if args.stream:
            result = common.print_stream(engine.caption(image, stream=True, **kwargs))
        else:
            result = engine.caption(image, **kwargs)
    if args.json:
        common.print_json(common.result_to_dict(result))
    elif not args.stream:
        print(result.caption)
    return 0

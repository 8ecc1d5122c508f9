"""``kestrel query IMAGE QUESTION``: ask one question about one image; ``--json-schema FILE``
holds the answer to a JSON schema (docs/structured.md), ``--stop TEXT`` ends it at a string."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kestrel.errors import InvalidInputError

from . import common


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = common.add_command(
        subparsers, "query", run, "IMAGE", "QUESTION", help="answer a question about an image",
        description="Answer a question about an image. IMAGE may be '-' to read it from stdin.",
    )  # fmt: skip
    parser.add_argument("--reasoning", action="store_true", help="think before answering")
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        type=Path,
        help="answer with JSON that follows the JSON schema in FILE",
    )
    parser.add_argument("--stop", metavar="TEXT", action="append",
                        help="end the answer where TEXT first appears (repeatable)")  # fmt: skip
    common.add_output_options(parser)
    common.add_engine_options(parser)
    common.add_generation_options(parser)


def response_format(path: Path | None) -> dict[str, Any] | None:
    """``--json-schema FILE`` as a ``response_format`` (None without it)."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--json-schema {path}: not a readable JSON file ({exc})") from None
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}


def run(args: argparse.Namespace) -> int:
    common.check_image_arg(args.image)
    image = common.read_image_arg(args.image)
    shape = response_format(args.json_schema)  # a bad file fails before the model loads
    with common.open_engine(args) as engine:
        kwargs = {
            "settings": common.settings_from_args(args),
            "adapter": common.adapter_name(args),
            "reasoning": args.reasoning,
            "stop": args.stop,
            "response_format": shape,
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

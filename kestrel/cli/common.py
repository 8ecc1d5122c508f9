"""What every subcommand shares: engine options (their flags are ``engine_flags.py``'s) and
generation options, engine construction, result printing and the one-line error convention
(``kestrel: error: ...``).

The engine module is imported inside :func:`open_engine`, when a command first needs one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel.cli.engine_flags import (
    add_engine_options,
    add_model_loading_options,
    budget_number,
    engine_kwargs,
    engine_options,
    int_in,
    positive_int,
)
from kestrel.errors import InvalidInputError, KestrelError

if TYPE_CHECKING:
    from kestrel.engine import Engine

__all__ = [
    "ADAPTER",
    "UsageError",
    "adapter_name",
    "add_command",
    "add_engine_options",
    "add_generation_options",
    "add_model_loading_options",
    "add_output_options",
    "add_region_command",
    "budget_number",
    "check_image_arg",
    "engine_kwargs",
    "engine_options",
    "int_in",
    "note_if_empty",
    "open_engine",
    "positive_int",
    "print_json",
    "print_stream",
    "read_image_arg",
    "result_to_dict",
    "run_region_command",
    "settings_from_args",
]

ADAPTER = "cli"  # the name the --adapter file is loaded under
# Generation flags -> the settings dict keys of the engine (only flags the user gave are sent).
_SETTINGS_KEYS = ("temperature", "top_p", "max_tokens", "max_objects", "seed")


class UsageError(InvalidInputError):
    """A bad command line: a file or folder that is not there, a model that cannot be read."""


def add_generation_options(parser: argparse.ArgumentParser, *, objects: bool = False) -> None:
    group = parser.add_argument_group("generation")
    if objects:
        group.add_argument("--max-objects", type=positive_int, default=None, metavar="N")
    else:
        group.add_argument("--max-tokens", type=positive_int, default=None, metavar="N")
        group.add_argument("--temperature", type=float, default=None, metavar="T")
        group.add_argument("--top-p", type=float, default=None, metavar="P")
        group.add_argument("--seed", type=int, default=None)
    group.add_argument(
        "--adapter", default=None, metavar="PATH",
        help="LoRA adapter to apply (.safetensors, reference final.pt, or a folder of one)",
    )  # fmt: skip


def add_output_options(parser: argparse.ArgumentParser, *, stream: bool = True) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--json",
        action="store_true",
        help="print the whole result (metrics too) as one JSON object",
    )
    if stream:
        group.add_argument(
            "--stream", action="store_true", help="print the text as it is generated"
        )


def add_ray_options(
    parser: argparse.ArgumentParser, *, ray: str, replicas: str, routing: str
) -> argparse._ArgumentGroup:
    """``--ray``, ``--ray-address``, ``--replicas``, ``--routing`` (``kestrel batch`` and
    ``kestrel serve``; the help of the three that differ is the caller's). Returns the group."""
    group = parser.add_argument_group("Ray (needs kestrel[ray]; see docs/distributed.md)")
    group.add_argument("--ray", action="store_true", help=ray)
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (default: $RAY_ADDRESS, else start a local instance)",
    )
    group.add_argument("--replicas", type=positive_int, default=None, metavar="N", help=replicas)
    group.add_argument("--routing", choices=("image", "random"), default="image", help=routing)
    return group


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    run: Any,
    *positionals: str,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand's parser, running ``run(args)``, with its ``positionals`` (metavars such as
    ``IMAGE``; each one's ``args`` attribute is its lower case) first."""
    parser = subparsers.add_parser(name, help=help, description=description)
    for metavar in positionals:
        parser.add_argument(metavar.lower(), metavar=metavar)
    parser.set_defaults(run=run)
    return parser


def add_region_command(
    subparsers: argparse._SubParsersAction, name: str, line: Any, *, help: str, description: str
) -> None:
    """The parser shared by ``point`` and ``detect``: IMAGE OBJECT, greedy, --max-objects;
    the command prints ``line(item)`` for each item found."""
    run = functools.partial(run_region_command, skill=name, line=line)
    parser = add_command(subparsers, name, run, help=help, description=description)
    parser.add_argument("image", metavar="IMAGE", help="image file, or '-' for stdin")
    parser.add_argument("object", metavar="OBJECT", help='what to look for, e.g. "face"')
    add_output_options(parser, stream=False)
    add_engine_options(parser)
    add_generation_options(parser, objects=True)


def run_region_command(args: argparse.Namespace, *, skill: str, line: Any) -> int:
    """Run ``engine.point`` or ``engine.detect`` for the command line's IMAGE and OBJECT and
    print the result: its JSON, or a line per point or box (a note when there is none)."""
    check_image_arg(args.image)
    image = read_image_arg(args.image)
    with open_engine(args) as engine:
        call = getattr(engine, skill)
        result = call(
            image, args.object, settings=settings_from_args(args), adapter=adapter_name(args)
        )
    if args.json:
        print_json(result_to_dict(result))
        return 0
    found = result.points if skill == "point" else result.objects
    for item in found:
        print(line(item))
    note_if_empty(found, args.object)
    return 0


def note_if_empty(found: Sequence[Any], what: str) -> None:
    if not found:
        print(f"no {what!r} found", file=sys.stderr)


def print_stream(stream: Any) -> Any:
    """Print a TextStream's deltas as they arrive, then a newline; returns its result."""
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return stream.result()


def settings_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The settings dict holding only the generation flags given on the command line."""
    settings = {k: getattr(args, k) for k in _SETTINGS_KEYS if getattr(args, k, None) is not None}
    return settings or None


def open_engine(args: argparse.Namespace) -> Engine:
    """An Engine for the command's options, with ``--adapter`` loaded as :data:`ADAPTER`.
    A model that cannot be loaded (missing directory, bad checkpoint, offline hub id) is a
    KestrelError with the loader's message."""
    from kestrel.engine import Engine

    if args.adapter is not None and not Path(args.adapter).expanduser().exists():
        raise UsageError(f"no such adapter file or folder: {args.adapter}")
    try:
        engine = Engine(args.model, engine_options(args))
    except KestrelError:
        raise
    except (OSError, ValueError) as exc:  # loader errors the engine did not wrap
        raise UsageError(f"cannot load model {args.model!r}: {exc}") from exc
    if args.adapter is not None:
        try:
            engine.load_adapter(ADAPTER, Path(args.adapter).expanduser())
        except BaseException:
            engine.close()
            raise
    return engine


def adapter_name(args: argparse.Namespace) -> str | None:
    """The ``adapter=`` argument of the engine calls: :data:`ADAPTER` when one was given."""
    return None if args.adapter is None else ADAPTER


def check_image_arg(image: str) -> None:
    """Fail before the (slow) model load when the image file is not there."""
    if image != "-" and not Path(image).expanduser().is_file():
        raise UsageError(f"no such image file: {image}")


def read_image_arg(image: str) -> str | bytes:
    """The IMAGE argument as the engine takes it: a path, or the bytes of stdin for ``-``."""
    return sys.stdin.buffer.read() if image == "-" else image


def result_to_dict(result: Any) -> dict[str, Any]:
    """A result dataclass as plain JSON values (tuples -> lists, nested values -> dicts)."""
    return {f.name: _jsonable(getattr(result, f.name)) for f in dataclasses.fields(result)}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return result_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def print_json(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False))

"""The ``kestrel`` command line (``kestrel ...`` or ``python -m kestrel ...``).

Each subcommand is a module of this package listed in ``COMMANDS``; a module provides
``register(subparsers)``, which adds its parser(s) and sets ``run=<function(args) -> int>`` as
the parser default. Adding a subcommand (``serve``, ``demo``) is one new module plus one entry.

Errors: a :class:`~kestrel.errors.KestrelError` prints one ``kestrel: error: ...`` line to stderr
and exits 2 for bad input (missing image, bad settings or options) or 1 for anything else the
engine failed at (a model that does not load, a request the model failed); argparse usage
errors exit 2 as usual.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kestrel import __version__
from kestrel.errors import InvalidInputError, KestrelError, UnknownAdapterError

__all__ = ["COMMANDS", "build_parser", "main"]

PROG = "kestrel"
# Subcommand modules, in --help order.
COMMANDS: tuple[str, ...] = (
    "demo", "query", "chat", "caption", "point", "detect", "batch", "serve",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Kestrel: fast Moondream 2 inference from the command line."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit status (the console script exits with it)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KestrelError as exc:
        _error(exc)
        return 2 if isinstance(exc, (InvalidInputError, UnknownAdapterError)) else 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:  # `kestrel ... | head`: the reader left; not an error of ours
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # an output file that cannot be written, a full disk, ...
        _error(exc)
        return 1


def _error(message: object) -> None:
    text = " ".join(str(message).split()) or type(message).__name__
    print(f"{PROG}: error: {text}", file=sys.stderr)

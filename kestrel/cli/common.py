"""What every subcommand shares: engine and generation options, engine construction, result
printing and the one-line error convention (``kestrel: error: ...``).

The engine module is imported inside :func:`open_engine`, when a command first needs one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kestrel.errors import InvalidInputError, KestrelError

if TYPE_CHECKING:
    from kestrel.engine import Engine

__all__ = [
    "ADAPTER",
    "UsageError",
    "adapter_name",
    "add_engine_options",
    "add_generation_options",
    "add_model_loading_options",
    "add_output_options",
    "add_region_command",
    "check_image_arg",
    "engine_kwargs",
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


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or Hugging Face repo id (default: the embedded default model)",
    )
    group.add_argument("--device", default="auto", help='"auto", "cpu", "cuda", "cuda:1", ...')
    group.add_argument("--dtype", default=None, help='"float32", "bfloat16" (default: auto)')
    group.add_argument("--max-batch-size", type=positive_int, default=16, metavar="N")
    group.add_argument(
        "--kv-cache-pages", type=positive_int, default=None, metavar="N",
        help="KV page pool size (default: sized from free device memory)",
    )  # fmt: skip
    group.add_argument(
        "--no-prefix-cache", action="store_true", help="disable prefix (KV) reuse across requests"
    )
    group.add_argument("--attention-backend", default="auto", metavar="NAME")
    group.add_argument(
        "--compile", action="store_true",
        help="run the decode step through torch.compile (opt-in, experimental: each batch "
        "size compiles on first use, about a minute per shape for Moondream 2)",
    )  # fmt: skip
    group.add_argument(
        "--no-lookahead", action="store_true",
        help="read each decode step's tokens before queueing the next (on CUDA the next step "
        "is queued first by default; docs/kernels.md)",
    )  # fmt: skip
    group.add_argument(
        "--keep-exif-orientation", action="store_true",
        help="read images in their stored orientation instead of turning them upright by their "
        "EXIF orientation tag (coordinates then refer to the stored pixels)",
    )  # fmt: skip
    group.add_argument(
        "--image-memory-mb", type=_memory_mb, default=None, metavar="MB",
        help="decoded image bytes held at once by requests in flight; past it a decode waits "
        "(the server answers 503 + Retry-After after 30 s). Default: a sixteenth of the "
        "machine's memory, 256 to 1024 MB",
    )  # fmt: skip
    for flag, unit, text in _TIER_FLAGS:  # the cache tiers past the KV pool
        group.add_argument(flag, type=budget_number, default=None, metavar=unit, help=text)
    group.add_argument(
        "--host-crops", action="store_true",
        help="make every image's crops on the host's crop workers (by default a CUDA model cuts "
        "a lone new image's crops on the GPU, to libvips' bytes)",
    )  # fmt: skip
    add_model_loading_options(group)


_TIER_FLAGS = (
    ("--embedding-cache-mb", "MB", "budget of the image-embedding tier, which keeps what the "
     "vision encoder made for an image after its KV is evicted (default: sized from the KV "
     "pool; 0: off)"),
    ("--host-kv-gb", "GB", "CUDA only: keep KV pages the prefix cache evicts in this much "
     "pinned host memory and copy them back on a later match (default and 0: off)"),
)  # fmt: skip

# --moe-weights / --kv-dtype: the command-line spelling -> the Engine kwarg ("auto" is None)
MOE_WEIGHTS_CHOICES = ("auto", "fp8", "dequantize")
KV_DTYPE_CHOICES = ("auto", "fp8")


def add_model_loading_options(group: argparse._ActionsContainer) -> None:
    """``--moe-weights`` and ``--kv-dtype``: how a Moondream 3 checkpoint's experts and the KV
    pages are held (``Engine(moe_weights=..., kv_dtype=...)``; docs/cli.md). The values are
    checked by the Engine's own checks, so a bad one gets the API's message."""
    group.add_argument(
        "--moe-weights", type=_moe_weights, default=None, metavar="{auto,fp8,dequantize}",
        help="Moondream 3 experts: fp8 keeps FP8 experts as FP8 (fetching a repo's FP8 file), "
        "dequantize widens them to the model dtype; auto (default) keeps what the file holds",
    )  # fmt: skip
    group.add_argument(
        "--kv-dtype", type=_kv_dtype, default=None, metavar="{auto,fp8}",
        help="KV cache pages: fp8 stores them as float8_e4m3 with the checkpoint's scales (about "
        "half the memory); auto (default) uses the model dtype",
    )  # fmt: skip


def _moe_weights(text: str) -> str | None:
    from kestrel.engine.setup import check_moe_weights

    return _checked(text, check_moe_weights, MOE_WEIGHTS_CHOICES)


def _kv_dtype(text: str) -> str | None:
    from kestrel.engine.setup import check_kv_dtype

    return _checked(text, check_kv_dtype, KV_DTYPE_CHOICES)


def _checked(text: str, check, choices: tuple[str, ...]) -> str | None:
    """``auto`` -> None; anything else through the Engine's check, its message kept."""
    value = None if text == "auto" else text
    try:
        check(value)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (here: {', '.join(choices)})") from None
    return value


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


def add_region_command(subparsers, name: str, *, help: str, description: str, run) -> None:
    """The parser shared by ``point`` and ``detect``: IMAGE OBJECT, greedy, --max-objects."""
    parser = subparsers.add_parser(name, help=help, description=description)
    parser.add_argument("image", metavar="IMAGE", help="image file, or '-' for stdin")
    parser.add_argument("object", metavar="OBJECT", help='what to look for, e.g. "face"')
    add_output_options(parser, stream=False)
    add_engine_options(parser)
    add_generation_options(parser, objects=True)
    parser.set_defaults(run=run)


def run_region_command(args: argparse.Namespace, skill: str) -> Any:
    """Run ``engine.point`` or ``engine.detect`` for the command line's IMAGE and OBJECT."""
    check_image_arg(args.image)
    image = read_image_arg(args.image)
    with open_engine(args) as engine:
        call = getattr(engine, skill)
        return call(
            image, args.object, settings=settings_from_args(args), adapter=adapter_name(args)
        )


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


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "kv_cache_pages": args.kv_cache_pages,
        "max_batch_size": args.max_batch_size,
        "enable_prefix_cache": not args.no_prefix_cache,
        "attention_backend": args.attention_backend,
        "compile": args.compile,
        "lookahead": False if args.no_lookahead else None,
        "exif_orientation": not args.keep_exif_orientation,
        "moe_weights": args.moe_weights,
        "kv_dtype": args.kv_dtype,
        **({"embedding_cache_mb": args.embedding_cache_mb}
           if args.embedding_cache_mb is not None else {}),
        **({"host_kv_gb": args.host_kv_gb} if args.host_kv_gb is not None else {}),
        **({"device_crops": False} if args.host_crops else {}),
        **({"image_memory_mb": args.image_memory_mb}
           if getattr(args, "image_memory_mb", None) is not None else {}),
    }  # fmt: skip


def open_engine(args: argparse.Namespace) -> Engine:
    """An Engine for the command's options, with ``--adapter`` loaded as :data:`ADAPTER`.
    A model that cannot be loaded (missing directory, bad checkpoint, offline hub id) is a
    KestrelError with the loader's message."""
    from kestrel.engine import Engine

    if args.adapter is not None and not Path(args.adapter).expanduser().exists():
        raise UsageError(f"no such adapter file or folder: {args.adapter}")
    try:
        engine = Engine(args.model, **engine_kwargs(args))
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


_DECIMAL = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")  # no inf, nan or words


def budget_number(text: str) -> float:
    """A cache budget: a finite number >= 0 (0 turns the tier off)."""
    value = float(text) if _DECIMAL.fullmatch(text) else -1.0
    if not math.isfinite(value) or value < 0:  # 1e999 is inf
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _memory_mb(text: str) -> float:
    value = budget_number(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number of megabytes > 0, got 0")
    return value


def int_in(text: str, low: int, high: int | None, what: str) -> int:
    """``text`` as an integer in ``low..high`` (``high`` None: no upper bound); argparse's error
    naming ``what`` otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_in(text, 1, None, "a positive integer")

"""The engine options on the command line: one flag per field of
:class:`~kestrel.engine.options.EngineOptions` (:data:`ENGINE_FLAGS`), or a reason why a field
has none (:data:`NOT_ON_CLI`); ``tests/unit/test_engine_options.py`` fails on a field that has
neither. Every command that loads a model takes them (``add_engine_options``) and builds its
Engine from them (``engine_options``, which the Ray replicas take too; ``engine_kwargs``: the
options the command line sets, as keywords). Also the argument types the commands share.

The engine package is imported only where an Engine's own check or value is needed.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kestrel.errors import InvalidInputError

if TYPE_CHECKING:
    from kestrel.engine.options import EngineOptions

__all__ = [
    "ENGINE_FLAGS",
    "KV_DTYPE_CHOICES",
    "MOE_WEIGHTS_CHOICES",
    "NOT_ON_CLI",
    "add_engine_options",
    "add_model_loading_options",
    "budget_number",
    "engine_kwargs",
    "engine_options",
    "flag_dest",
    "int_in",
    "positive_int",
]

# --moe-weights / --kv-dtype: the command-line spelling -> the Engine kwarg ("auto" is None)
MOE_WEIGHTS_CHOICES = ("auto", "fp8", "dequantize")
KV_DTYPE_CHOICES = ("auto", "fp8")
_DECIMAL = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")  # no inf, nan or words


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


def _checked(text: str, check: Callable[[object], None], choices: tuple[str, ...]) -> str | None:
    """``auto`` -> None; anything else through the Engine's check, its message kept, so a bad
    value gets the API's message."""
    value = None if text == "auto" else text
    try:
        check(value)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (here: {', '.join(choices)})") from None
    return value


def _moe_weights(text: str) -> str | None:
    from kestrel.engine.setup import check_moe_weights

    return _checked(text, check_moe_weights, MOE_WEIGHTS_CHOICES)


def _kv_dtype(text: str) -> str | None:
    from kestrel.engine.setup import check_kv_dtype

    return _checked(text, check_kv_dtype, KV_DTYPE_CHOICES)


_UNSET = object()  # the flag was not given: the Engine's default stands (the option is left out)


def _same(value: Any) -> Any:
    return value


def _negated(value: Any) -> bool:
    return not value


def _if_given(value: Any) -> Any:
    return _UNSET if value is None else value


def _off_or_none(value: Any) -> bool | None:
    return False if value else None


def _off_if_given(value: Any) -> Any:
    return False if value else _UNSET


def _help_texts(block: str) -> dict[str, str]:
    """``--flag  text`` lines (a text may go on over indented lines) -> {flag: text}."""
    found: dict[str, str] = {}
    for line in block.strip().splitlines():
        if line.startswith("--"):
            flag, _, line = line.partition("  ")
            found[flag] = ""
        found[flag] = f"{found[flag]} {line.strip()}".strip()
    return found


_HELP = _help_texts("""
--device  "auto", "cpu", "cuda", "cuda:1", ...
--dtype  "float32", "bfloat16" (default: auto)
--kv-cache-pages  KV page pool size (default: sized from free device memory)
--no-prefix-cache  disable prefix (KV) reuse across requests
--compile  run the decode step through torch.compile (opt-in, experimental: each batch size
    compiles on first use, about a minute per shape for Moondream 2)
--no-lookahead  read each decode step's tokens before queueing the next (on CUDA the next step
    is queued first by default; docs/kernels.md)
--keep-exif-orientation  read images in their stored orientation instead of turning them
    upright by their EXIF orientation tag (coordinates then refer to the stored pixels)
--image-memory-mb  decoded image bytes held at once by requests in flight; past it a decode
    waits (the server answers 503 + Retry-After after 30 s). Default: a sixteenth of the
    machine's memory, 256 to 1024 MB
--embedding-cache-mb  budget of the image-embedding tier, which keeps what the vision encoder
    made for an image after its KV is evicted (default: sized from the KV pool; 0: off)
--host-kv-gb  CUDA only: keep KV pages the prefix cache evicts in this much pinned host memory
    and copy them back on a later match (default and 0: off)
--host-crops  make every image's crops on the host's crop workers (by default a CUDA model
    cuts a lone new image's crops on the GPU, to libvips' bytes)
--moe-weights  Moondream 3 experts: fp8 keeps FP8 experts as FP8 (fetching a repo's FP8 file),
    dequantize widens them to the model dtype; auto (default) keeps what the file holds
--kv-dtype  KV cache pages: fp8 stores them as float8_e4m3 with the checkpoint's scales (about
    half the memory); auto (default) uses the model dtype
""")
_ON = {"action": "store_true"}
Flag = tuple[str, dict[str, Any], Callable[[Any], Any]]  # flag, argparse keywords, -> value
# EngineOptions field -> its flag (its help is _HELP's), in --help order
ENGINE_FLAGS: dict[str, Flag] = {
    "device": ("--device", {"default": "auto"}, _same),
    "dtype": ("--dtype", {"default": None}, _same),
    "max_batch_size": ("--max-batch-size", {"type": positive_int, "default": 16, "metavar": "N"},
                       _same),
    "kv_cache_pages": ("--kv-cache-pages", {"type": positive_int, "metavar": "N"}, _same),
    "enable_prefix_cache": ("--no-prefix-cache", _ON, _negated),
    "attention_backend": ("--attention-backend", {"default": "auto", "metavar": "NAME"}, _same),
    "compile": ("--compile", _ON, _same),
    "lookahead": ("--no-lookahead", _ON, _off_or_none),
    "exif_orientation": ("--keep-exif-orientation", _ON, _negated),
    "image_memory_mb": ("--image-memory-mb", {"type": _memory_mb, "metavar": "MB"}, _if_given),
    "embedding_cache_mb": ("--embedding-cache-mb", {"type": budget_number, "metavar": "MB"},
                           _if_given),
    "host_kv_gb": ("--host-kv-gb", {"type": budget_number, "metavar": "GB"}, _if_given),
    "device_crops": ("--host-crops", _ON, _off_if_given),
    "moe_weights": ("--moe-weights", {"type": _moe_weights, "metavar": "{auto,fp8,dequantize}"},
                    _same),
    "kv_dtype": ("--kv-dtype", {"type": _kv_dtype, "metavar": "{auto,fp8}"}, _same),
}  # fmt: skip
_MODEL_LOADING = ("moe_weights", "kv_dtype")  # add_model_loading_options' own
# EngineOptions fields without a flag, and why: the commands keep the Engine's default
NOT_ON_CLI = {
    "max_adapters": "kestrel serve loads the --adapter files it is given, the others one",
    "retain_decoded": "a library caller's memory knob: the commands keep answers cached",
}


def flag_dest(flag: str) -> str:
    """The ``args`` attribute argparse gives ``flag``."""
    return flag.lstrip("-").replace("-", "_")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """``--model`` and a flag for each engine option (``--moe-weights`` and ``--kv-dtype``
    last, :func:`add_model_loading_options`)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or Hugging Face repo id (default: the embedded default model)",
    )
    _add(group, [option for option in ENGINE_FLAGS if option not in _MODEL_LOADING])
    add_model_loading_options(group)


def add_model_loading_options(group: argparse._ActionsContainer) -> None:
    """``--moe-weights`` and ``--kv-dtype``: how a Moondream 3 checkpoint's experts and the KV
    pages are held (``Engine(moe_weights=..., kv_dtype=...)``; docs/cli.md). The values are
    checked by the Engine's own checks, so a bad one gets the API's message."""
    _add(group, _MODEL_LOADING)


def _add(group: argparse._ActionsContainer, options: Sequence[str]) -> None:
    for option in options:
        flag, kwargs, _ = ENGINE_FLAGS[option]
        group.add_argument(flag, **kwargs, help=_HELP.get(flag))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the command line sets, as ``Engine`` keywords: a flag not given
    that only ever overrides (``--host-crops``, the budgets) is left out, and so is any flag
    the command's parser lacks."""
    found: dict[str, Any] = {}
    for option, (flag, _, value) in ENGINE_FLAGS.items():
        dest = flag_dest(flag)
        if hasattr(args, dest) and (v := value(getattr(args, dest))) is not _UNSET:
            found[option] = v
    return found


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The command line's :class:`~kestrel.engine.options.EngineOptions`."""
    from kestrel.engine.options import EngineOptions

    return EngineOptions(**engine_kwargs(args))

"""Building what an Engine runs on: device and dtype choice, the model, adapters.

Every failure here is a :class:`~kestrel.errors.ModelLoadError` (or an
:class:`~kestrel.errors.InvalidInputError` for a bad option) with a message that says what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kestrel.crops.pool import start_workers
from kestrel.embedding_cache import GIB, MIB, BudgetError, budget_bytes, host_memory_bytes
from kestrel.engine.options import EngineOptions, takes_options
from kestrel.errors import InvalidInputError, ModelLoadError
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.weights import MOE_WEIGHT_MODES, load_kv_scales, resolve_checkpoint
from kestrel.runtime.compiled import compile_unavailable_reason
from kestrel.runtime.host_kv import host_kv_unavailable_reason
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tiny import MODEL_DIR
from kestrel_kernels.contract import KvScales

__all__ = [
    "DEFAULT_MODEL_DIR",
    "check_kv_dtype",
    "check_moe_weights",
    "load_model",
    "load_runtime",
    "model_loader",
    "resolve_device",
    "resolve_dtype",
]

DEFAULT_MODEL_DIR = MODEL_DIR  # the embedded kestrel-tiny

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA when available, else CPU. Anything else must exist here."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"bad device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device {device!r} asked for, but CUDA is not available here")
    return dev


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype, its name ("float32", "bfloat16", "float16", short forms), or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise InvalidInputError(
        f"unknown dtype {dtype!r}; use a torch.dtype or one of float32, bfloat16, float16"
    )


def device_memory_bytes(dev: torch.device) -> int | None:
    """The memory a tier on ``dev`` would live in: the GPU's, or the host's."""
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    return host_memory_bytes()


def embedding_budget(value: object, dev: torch.device) -> int | None:
    """``embedding_cache_mb`` (None: the default, sized from the KV pool) in bytes, checked."""
    if value is None:
        return None
    try:
        return budget_bytes(value, name="embedding_cache_mb", unit=MIB,
                            limit=device_memory_bytes(dev))  # fmt: skip
    except BudgetError as exc:
        raise InvalidInputError(str(exc)) from exc


def host_kv_budget(value: object, dev: torch.device) -> int:
    """``host_kv_gb`` (None or 0: off) in bytes of host memory, checked; refused off CUDA."""
    if value is None:
        return 0
    try:
        size = budget_bytes(value, name="host_kv_gb", unit=GIB, limit=host_memory_bytes())
    except BudgetError as exc:
        raise InvalidInputError(str(exc)) from exc
    reason = host_kv_unavailable_reason(dev) if size else None
    if reason is not None:
        raise InvalidInputError(f"host_kv_gb={value!r}: {reason}")
    return size


def _model_source(model: str | Path | None) -> str | Path:
    if model is not None:
        return model
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return DEFAULT_MODEL_DIR
    raise ModelLoadError(
        "Engine(model=None) uses the embedded kestrel-tiny model, which this installation does "
        "not include; pass a checkpoint directory or a Hugging Face repo id as `model`"
    )


KV_DTYPES = ("fp8",)
# the EngineOptions fields MoondreamRuntime takes as they are (its keywords of the same names)
RUNTIME_OPTIONS = ("kv_cache_pages", "max_batch_size", "enable_prefix_cache",
                   "attention_backend", "retain_decoded", "compile", "device_crops")  # fmt: skip
Loaded = tuple[MoondreamModel, MoondreamTokenizer, tuple[KvScales, ...] | None]
ModelLoader = Callable[
    [str | Path, torch.device, torch.dtype | None, str | None, str | None], Loaded
]
_LOADERS: list[ModelLoader] = []  # model_loader()'s, innermost last; none: load_model


@contextlib.contextmanager
def model_loader(loader: ModelLoader) -> Iterator[None]:
    """While active, :func:`load_runtime` (so ``Engine``) loads through ``loader``, called as
    :func:`load_model` is (it may call ``load_model`` for the sources it leaves alone). A bench
    and test hook, process-wide: ``scripts/bench_gpu_models.py`` makes a random Moondream 3 on
    the device this way instead of writing and reading a 10 GB checkpoint."""
    _LOADERS.append(loader)
    try:
        yield
    finally:
        _LOADERS.remove(loader)


def load_model(
    source: str | Path,
    device: torch.device,
    dtype: torch.dtype | None,
    moe_weights: str | None,
    kv_dtype: str | None,
) -> Loaded:
    """The model (its experts in the ``moe_weights`` form), tokenizer and, for
    ``kv_dtype="fp8"``, the checkpoint's KV scales; a hub id is resolved once
    (``moe_weights="fp8"`` prefers a repo's ``model_fp8.pt``)."""
    ckpt = resolve_checkpoint(source, prefer_fp8=moe_weights == "fp8")
    model = MoondreamModel.from_pretrained(
        ckpt, device=device, dtype=dtype, moe_weights=moe_weights
    )
    kv_scales = None
    if kv_dtype == "fp8":
        kv_scales = load_kv_scales(ckpt, model.config)
        if kv_scales is None:
            raise ValueError(
                "kv_dtype='fp8' needs FP8 KV scales (text_model.transformer.h.N.kv_quantizer."
                "{k_scale, v_scale}) in every layer of the checkpoint, and this one lacks them; "
                "leave kv_dtype unset for KV pages in the model dtype"
            )
    return model, MoondreamTokenizer.for_checkpoint(ckpt), kv_scales


def check_moe_weights(moe_weights: object) -> None:
    """``Engine(moe_weights=...)``'s check (the CLI's ``--moe-weights`` runs it too)."""
    if moe_weights not in (None, *MOE_WEIGHT_MODES):
        raise InvalidInputError(
            f"moe_weights must be one of {MOE_WEIGHT_MODES} or None, got {moe_weights!r}"
        )


def check_kv_dtype(kv_dtype: object) -> None:
    """``Engine(kv_dtype=...)``'s check (the CLI's ``--kv-dtype`` runs it too)."""
    if kv_dtype not in (None, *KV_DTYPES):
        raise InvalidInputError(
            f"kv_dtype must be 'fp8' (FP8 KV pages) or None (the model dtype), got {kv_dtype!r}"
        )


def _check_sizes(o: EngineOptions, dev: torch.device) -> None:
    """The options ``load_runtime`` checks before anything loads (each with its message)."""
    if not isinstance(o.compile, bool):
        raise InvalidInputError(f"compile must be True or False, got {o.compile!r}")
    if o.compile:
        reason = compile_unavailable_reason(dev)
        if reason is not None:
            raise InvalidInputError(f"compile=True cannot work here: {reason}")
    size = o.max_batch_size
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidInputError(f"max_batch_size must be an int, got {size!r}")
    if size < 1:
        raise InvalidInputError(f"max_batch_size must be >= 1, got {size}")
    pages = o.kv_cache_pages
    if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int)):
        raise InvalidInputError(f"kv_cache_pages must be an int, got {pages!r}")
    check_moe_weights(o.moe_weights)
    check_kv_dtype(o.kv_dtype)


@takes_options
def load_runtime(
    model: str | Path | None = None, options: EngineOptions | None = None, **overrides: Any
) -> tuple[MoondreamRuntime, str]:
    """Load the checkpoint and build its runtime; returns (runtime, where it came from).
    ``options`` (or their fields as keywords, as ``Engine`` takes them): this reads the
    model's and the runtime's, and checks them first.

    ``compile``: run decode through ``torch.compile`` (``kestrel.runtime.compiled``); refused
    up front, with the reason, where inductor cannot compile for the device.
    ``embedding_cache_mb``: the image-embedding tier's budget (None: sized from the KV pool;
    0: off); ``host_kv_gb``: pinned host memory for evicted KV pages (CUDA; None or 0: off);
    ``device_crops``: a lone new image's crops cut on the device (None: on CUDA, if probed)."""
    o = EngineOptions.of(options, **overrides)
    source = _model_source(model)
    dev, dt = resolve_device(o.device), resolve_dtype(o.dtype)
    embedding_bytes = embedding_budget(o.embedding_cache_mb, dev)
    host_bytes = host_kv_budget(o.host_kv_gb, dev)
    _check_sizes(o, dev)
    if dev.type == "cuda":  # the crop worker processes import while the model loads
        start_workers()
    try:
        load = _LOADERS[-1] if _LOADERS else load_model
        model, tokenizer, kv_scales = load(source, dev, dt, o.moe_weights, o.kv_dtype)
        rt = MoondreamRuntime(
            model, tokenizer, kv_scales=kv_scales, embedding_cache_bytes=embedding_bytes,
            host_kv_bytes=host_bytes, **{name: getattr(o, name) for name in RUNTIME_OPTIONS},
        )  # fmt: skip
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
        raise ModelLoadError(f"cannot load model {str(source)!r}: {exc}") from exc
    if rt.tokenizer is None:
        raise ModelLoadError(f"model {str(source)!r} has no tokenizer")
    return rt, str(source)

"""What an Engine is built with: :class:`EngineOptions`, one frozen value shared by ``Engine``,
:func:`~kestrel.engine.setup.load_runtime`, the command line (``kestrel/cli/common.py``: one
flag per option) and the Ray replicas (``ReplicaOptions.engine``).

A new option is one field here: ``Engine(...)`` and ``load_runtime(...)`` take every field as a
keyword (their signatures are made from the fields, :func:`parameters`), and a test fails
until the command line gives it a flag or says why it has none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from kestrel.engine.adapters import DEFAULT_MAX_ADAPTERS

if TYPE_CHECKING:
    import torch

__all__ = ["EngineOptions", "parameters", "takes_options"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """The options of :class:`kestrel.Engine` (its docstring says what each does). Values are
    checked where they are used (``Engine`` and ``load_runtime``), each with its own message,
    so a value built here is never refused before an Engine would refuse it."""

    device: str | torch.device = "auto"
    dtype: torch.dtype | str | None = None
    kv_cache_pages: int | None = None
    max_batch_size: int = 16
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    max_adapters: int = DEFAULT_MAX_ADAPTERS
    exif_orientation: bool = True
    retain_decoded: bool = True
    moe_weights: str | None = None
    kv_dtype: str | None = None
    compile: bool = False
    lookahead: bool | None = None
    embedding_cache_mb: float | None = None
    host_kv_gb: float | None = None
    device_crops: bool | None = None
    image_memory_mb: float | None = None

    @classmethod
    def of(
        cls, options: EngineOptions | Mapping[str, Any] | None = None, /, **overrides: Any
    ) -> EngineOptions:
        """``options`` (None: the defaults; a mapping: its keywords) with ``overrides`` set;
        an unknown name is a TypeError, as an unknown keyword of any call is."""
        if options is None:
            options = cls()
        elif isinstance(options, Mapping):
            options = cls(**options)
        elif not isinstance(options, cls):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        return replace(options, **overrides) if overrides else options


def parameters(value: type) -> list[inspect.Parameter]:
    """A dataclass's fields as the parameters of a call that takes them: its positional
    fields first, then its keyword-only ones, each with its default."""
    P = inspect.Parameter
    found = [
        P(f.name, P.KEYWORD_ONLY if f.kw_only else P.POSITIONAL_OR_KEYWORD,
          default=P.empty if f.default is MISSING else f.default, annotation=f.type)
        for f in fields(value)
    ]  # fmt: skip
    return sorted(found, key=lambda p: p.kind)  # stable: each kind keeps its fields' order


def takes_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``fn(..., options=None, **overrides)``: its signature then names every
    :class:`EngineOptions` field as a keyword-only parameter (what ``**overrides`` takes)."""
    own = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    fn.__signature__ = inspect.signature(fn).replace(  # type: ignore[attr-defined]
        parameters=[*own, *parameters(EngineOptions)]
    )
    return fn

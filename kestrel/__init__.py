"""Kestrel: a fast Moondream serving runtime built around a namespaced radix prefix cache."""

from __future__ import annotations

from kestrel.engine import Engine, EngineOptions
from kestrel.engine.streams import AsyncTextStream, TextStream
from kestrel.errors import (
    CapacityError,
    EngineClosedError,
    InvalidInputError,
    KestrelError,
    ModelError,
    ModelLoadError,
    OverloadedError,
    PromptTooLongError,
    UnknownAdapterError,
    UnsupportedError,
)
from kestrel.images import PreparedImage, prepare_image
from kestrel.results import (
    CaptionResult,
    ChatResult,
    DetectResult,
    EngineStats,
    PointResult,
    QueryResult,
    Reasoning,
    RequestMetrics,
    TextDelta,
    TokenLogprob,
)
from kestrel.skills.settings import Settings, parse_settings

__version__ = "0.1.0"

__all__ = [
    "AsyncTextStream",
    "CapacityError",
    "CaptionResult",
    "ChatResult",
    "DetectResult",
    "Engine",
    "EngineClosedError",
    "EngineOptions",
    "EngineStats",
    "InvalidInputError",
    "KestrelError",
    "ModelError",
    "ModelLoadError",
    "OverloadedError",
    "PointResult",
    "PreparedImage",
    "PromptTooLongError",
    "QueryResult",
    "Reasoning",
    "RequestMetrics",
    "Settings",
    "TextDelta",
    "TextStream",
    "TokenLogprob",
    "UnknownAdapterError",
    "UnsupportedError",
    "__version__",
    "parse_settings",
    "prepare_image",
]

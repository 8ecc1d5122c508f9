"""The Moondream 2 model: config, checkpoint loading, tokenizer, image crops, the model as plain
weight containers plus functions, the eager reference path and the cached runtime."""

from __future__ import annotations

from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig
from .eager import EagerMoondream
from .image_crops import OverlapCrops, normalize_pixels, overlap_crops, select_tiling
from .image_input import ImageError, image_digest, image_hash_int, load_image
from .lora import LoraAdapter, load_adapter
from .model import MoondreamModel
from .runtime import MoondreamRuntime, RuntimeCounters
from .sequence import SequenceError, SequenceState
from .tokenizer import MoondreamTokenizer, StreamDecoder, TokenizerError
from .weights import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_dtype,
    expected_shapes,
    load_config,
    load_state_dict,
    resolve_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "EagerMoondream",
    "ImageError",
    "LoraAdapter",
    "MoondreamConfig",
    "MoondreamModel",
    "MoondreamRuntime",
    "MoondreamTokenizer",
    "OverlapCrops",
    "RegionConfig",
    "RuntimeCounters",
    "SequenceError",
    "SequenceState",
    "StreamDecoder",
    "TextConfig",
    "TokenizerConfig",
    "TokenizerError",
    "VisionConfig",
    "checkpoint_dtype",
    "expected_shapes",
    "image_digest",
    "image_hash_int",
    "load_adapter",
    "load_config",
    "load_image",
    "load_state_dict",
    "normalize_pixels",
    "overlap_crops",
    "resolve_checkpoint",
    "select_tiling",
]

"""The Moondream 2 model and nothing else: config, checkpoint loading (Hugging Face layouts,
the hub), tokenizer, the model as plain weight containers plus functions (vision from
normalized crops on: normalization, encoder, projection; text, rope, region, LoRA), sampling.
It imports no layer above it: no runtime, cache, skills or engine, and not the crop wing
(``kestrel/crops/``), which cuts an image into the crops the vision tower takes and imports
this package, never the other way."""

from __future__ import annotations

from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig
from .lora import LoraAdapter, load_adapter
from .model import MoondreamModel
from .tokenizer import MoondreamTokenizer, StreamDecoder, TokenizerError
from .vision import VisionInputError, encode_image, normalize_pixels
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
    "LoraAdapter",
    "MoondreamConfig",
    "MoondreamModel",
    "MoondreamTokenizer",
    "RegionConfig",
    "StreamDecoder",
    "TextConfig",
    "TokenizerConfig",
    "TokenizerError",
    "VisionConfig",
    "VisionInputError",
    "checkpoint_dtype",
    "encode_image",
    "expected_shapes",
    "load_adapter",
    "load_config",
    "load_state_dict",
    "normalize_pixels",
    "resolve_checkpoint",
]

"""The Moondream 2 model and nothing else: config, checkpoint loading (Hugging Face layouts,
the hub), tokenizer, image crops, the model as plain weight containers plus functions (vision,
text, rope, region, LoRA), sampling. It imports no layer above it: no runtime, cache, skills or
engine."""

from __future__ import annotations

from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig
from .lora import LoraAdapter, load_adapter
from .model import MoondreamModel
from .tokenizer import MoondreamTokenizer, StreamDecoder, TokenizerError
from .vision import CropError, OverlapCrops, normalize_pixels, overlap_crops, select_tiling
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
    "CropError",
    "LoraAdapter",
    "MoondreamConfig",
    "MoondreamModel",
    "MoondreamTokenizer",
    "OverlapCrops",
    "RegionConfig",
    "StreamDecoder",
    "TextConfig",
    "TokenizerConfig",
    "TokenizerError",
    "VisionConfig",
    "checkpoint_dtype",
    "expected_shapes",
    "load_adapter",
    "load_config",
    "load_state_dict",
    "normalize_pixels",
    "overlap_crops",
    "resolve_checkpoint",
    "select_tiling",
]

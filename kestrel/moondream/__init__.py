"""The Moondream 2 model: config, checkpoint loading, tokenizer, image crops, and the model as
plain weight containers plus functions."""

from __future__ import annotations

from .config import MoondreamConfig, RegionConfig, TextConfig, TokenizerConfig, VisionConfig

__all__ = ["MoondreamConfig", "RegionConfig", "TextConfig", "TokenizerConfig", "VisionConfig"]

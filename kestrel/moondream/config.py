"""Moondream 2 and 3 configuration: frozen nested dataclasses with the production defaults.

The Hugging Face ``config.json`` of both families carries ``"config": {}``, so the defaults below
*are* the production models: the dataclass defaults are Moondream 2's, and
:data:`MOONDREAM3_DEFAULTS` lists the fields Moondream 3 changes (its MoE section, rotary theta,
context, single-Linear region decoders, one answer marker in query prompts). The family is
Moondream 3 when the config has a ``text.moe`` section (or the loader finds MoE tensors in the
checkpoint). Small test checkpoints spell their fields out under the same key. Model code reads
every size from here; nothing repeats a config value as a literal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = [
    "MOONDREAM2",
    "MOONDREAM3",
    "MoondreamConfig",
    "RegionConfig",
    "TextConfig",
    "TextMoeConfig",
    "TokenizerConfig",
    "VisionConfig",
]


MOONDREAM2 = "moondream2"
MOONDREAM3 = "moondream3"


class ConfigError(ValueError):
    """A config.json that cannot describe a Moondream model."""


def _build(cls: type, data: Mapping[str, Any] | None, where: str) -> Any:
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown} in config section '{where}'")
    return cls(**data)


@dataclass(frozen=True, slots=True)
class TextMoeConfig:
    """Moondream 3's mixture of experts: layers >= start_layer route each token to
    experts_per_token of num_experts GeGLU experts (inner width expert_inner_dim)."""

    num_experts: int = 64
    start_layer: int = 4
    experts_per_token: int = 8
    expert_inner_dim: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError("text.moe.experts_per_token must be in [1, num_experts]")


@dataclass(frozen=True, slots=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730  # unused: the bidirectional prefix is derived from the vision grid
    group_size: int | None = None  # int4 quantization group size; None = unquantized
    rope_theta: float = 10000.0
    moe: TextMoeConfig | None = None  # Moondream 3: MoE MLPs from moe.start_layer, tau attention

    def __post_init__(self) -> None:
        if isinstance(self.moe, Mapping):  # the reference's from_dict leaves it a dict
            object.__setattr__(self, "moe", _build(TextMoeConfig, self.moe, "text.moe"))
        if self.moe is not None and self.n_kv_heads != self.n_heads:
            # tau scales V per query head (the reference cannot run grouped-query attention)
            raise ConfigError("a Moondream 3 text model needs n_kv_heads == n_heads")
        if self.dim % self.n_heads:
            raise ConfigError(f"text.dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"text.n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head (the first half of each head; the rest pass through)."""
        return self.dim // (2 * self.n_heads)

    @property
    def qkv_dim(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.start_layer


@dataclass(frozen=True, slots=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4  # in patches
    proj_inner_dim: int = 8192

    def __post_init__(self) -> None:
        if self.crop_size % self.enc_patch_size:
            raise ConfigError("vision.crop_size must be a multiple of enc_patch_size")
        if self.enc_dim % self.enc_n_heads:
            raise ConfigError("vision.enc_dim must be divisible by enc_n_heads")
        if 2 * self.overlap_margin >= self.grid_side:
            raise ConfigError("vision.overlap_margin leaves no crop window")

    @property
    def grid_side(self) -> int:
        """Patches per crop side; also the side of the pooled local-feature grid."""
        return self.crop_size // self.enc_patch_size

    @property
    def n_patches(self) -> int:
        """Image tokens per image (729 in production)."""
        return self.grid_side**2

    @property
    def patch_dim(self) -> int:
        return self.enc_patch_size * self.enc_patch_size * self.in_channels

    @property
    def head_dim(self) -> int:
        return self.enc_dim // self.enc_n_heads


@dataclass(frozen=True, slots=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int | None = 8192  # decoder MLP width; None = single-Linear decoders (Moondream 3)
    group_size: int | None = None

    @property
    def coord_bins(self) -> int:
        return self.coord_out_dim

    @property
    def size_bins(self) -> int:
        return self.size_out_dim // 2


def _freeze_templates(raw: Mapping[str, Any]) -> Mapping[str, Mapping[str, tuple[int, ...]]]:
    out: dict[str, Mapping[str, tuple[int, ...]]] = {}
    for skill, parts in raw.items():
        if parts is None:
            continue
        if not isinstance(parts, Mapping):
            raise ConfigError(f"tokenizer.templates.{skill} must be an object")
        out[skill] = MappingProxyType({k: tuple(int(i) for i in v) for k, v in parts.items()})
    return MappingProxyType(out)


_DEFAULT_TEMPLATES: dict[str, dict[str, list[int]]] = {
    "caption": {
        "short": [1, 32708, 2, 12492, 3],
        "normal": [1, 32708, 2, 6382, 3],
        "long": [1, 32708, 2, 4059, 3],
    },
    "query": {"prefix": [1, 15381, 2], "suffix": [3]},
    "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
    "point": {"prefix": [1, 2581, 2], "suffix": [3]},
}


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    # Moondream 2 was trained with query prompts ending in the answer marker twice (template
    # suffix + one more); Moondream 3 ends them with the suffix alone.
    query_doubled_answer: bool = True
    # Point / detect after an object: Moondream 3 continues while the coord logit >= the eos
    # logit (only those two are computed); Moondream 2 takes the full-vocabulary argmax.
    continue_on_coord: bool = False
    templates: Mapping[str, Mapping[str, tuple[int, ...]]] = field(
        default_factory=lambda: _freeze_templates(_DEFAULT_TEMPLATES)
    )

    def __post_init__(self) -> None:
        if not isinstance(self.templates, MappingProxyType):
            object.__setattr__(self, "templates", _freeze_templates(self.templates))
        for skill in ("caption", "query", "detect", "point"):
            if skill not in self.templates:
                raise ConfigError(f"tokenizer.templates lacks the '{skill}' template")


# The fields where production Moondream 3 differs from Moondream 2 (the first-party reference's
# config.py and rope.py); everything else, the vision tower included, is shared.
MOONDREAM3_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "text": MappingProxyType(
            {"max_context": 4096, "rope_theta": 1_500_000.0, "moe": TextMoeConfig()}
        ),
        "region": MappingProxyType({"inner_dim": None}),
        "tokenizer": MappingProxyType({"query_doubled_answer": False, "continue_on_coord": True}),
    }
)


@dataclass(frozen=True, slots=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    def __post_init__(self) -> None:
        if self.vision.proj_out_dim != self.text.dim:
            raise ConfigError("vision.proj_out_dim must equal text.dim")
        if self.region.dim != self.text.dim:
            raise ConfigError("region.dim must equal text.dim")
        if self.prefix_len >= self.text.max_context:
            raise ConfigError("the image prefix does not fit in text.max_context")

    @property
    def family(self) -> str:
        """``"moondream3"`` for a mixture-of-experts text model, else ``"moondream2"``."""
        return MOONDREAM2 if self.text.moe is None else MOONDREAM3

    @property
    def image_tokens(self) -> int:
        """KV positions one image occupies (729 in production)."""
        return self.vision.n_patches

    @property
    def prefix_len(self) -> int:
        """BOS + image: the bidirectional block at the start of an image prompt (730)."""
        return 1 + self.image_tokens

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any] | None, *, family: str | None = None
    ) -> MoondreamConfig:
        """Build from the reference's nested dict; absent fields take the production defaults
        of the family: ``family`` if given, else Moondream 3 when ``text.moe`` is present."""
        data = dict(data or {})
        unknown = sorted(set(data) - {"text", "vision", "region", "tokenizer"})
        if unknown:
            raise ConfigError(f"unknown config section(s) {unknown}")
        if family is None:
            family = MOONDREAM3 if (data.get("text") or {}).get("moe") else MOONDREAM2
        if family not in (MOONDREAM2, MOONDREAM3):
            raise ConfigError(f"unknown model family {family!r}")
        base = MOONDREAM3_DEFAULTS if family == MOONDREAM3 else {}
        sections = {
            k: {**base.get(k, {}), **(data.get(k) or {})}
            for k in ("text", "vision", "region", "tokenizer")
        }
        return cls(
            text=_build(TextConfig, sections["text"], "text"),
            vision=_build(VisionConfig, sections["vision"], "vision"),
            region=_build(RegionConfig, sections["region"], "region"),
            tokenizer=_build(TokenizerConfig, sections["tokenizer"], "tokenizer"),
        )

    @classmethod
    def from_json_file(cls, path: str | Path, *, family: str | None = None) -> MoondreamConfig:
        """Read a checkpoint's ``config.json``: the model config is under its ``"config"`` key.

        A file holding the nested sections at top level is accepted too. The family is
        ``family`` if given, else Moondream 3 for ``model_type: moondream3`` or a ``text.moe``
        section, else Moondream 2.
        """
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        if family is None and raw.get("model_type") == MOONDREAM3:
            family = MOONDREAM3
        if "config" in raw:
            return cls.from_dict(raw["config"], family=family)
        sections = {"text", "vision", "region", "tokenizer"}
        return cls.from_dict({k: v for k, v in raw.items() if k in sections}, family=family)

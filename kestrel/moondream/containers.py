"""The weight containers of Moondream 2 and 3: frozen dataclasses of tensors, no behaviour.

Fields made with ``init=False`` are derived from the others when a container is built (never
read from or written to a checkpoint: ``model.state_dict`` skips them).

``model.py`` builds them from a state dict (and re-exports them); ``vision.py``, ``text.py``,
``region.py`` and ``moe.py`` take them as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "LayerNorm",
    "Linear",
    "MoeWeights",
    "RegionWeights",
    "TauWeights",
    "TextBlock",
    "TextWeights",
    "VisionBlock",
    "VisionWeights",
]


@dataclass(frozen=True, slots=True)
class Linear:
    """y = x @ weight.T + bias; weight [out, in] (PyTorch layout)."""

    weight: Tensor
    bias: Tensor | None


@dataclass(frozen=True, slots=True)
class LayerNorm:
    weight: Tensor
    bias: Tensor


@dataclass(frozen=True, slots=True)
class VisionBlock:
    ln1: LayerNorm
    qkv: Linear
    proj: Linear
    ln2: LayerNorm
    fc1: Linear
    fc2: Linear


@dataclass(frozen=True, slots=True)
class VisionWeights:
    patch_emb: Linear  # [enc_dim, patch_dim]
    pos_emb: Tensor  # [1, n_patches, enc_dim]
    blocks: tuple[VisionBlock, ...]
    post_ln: LayerNorm
    proj_fc1: Linear  # [proj_inner_dim, 2 * enc_dim]
    proj_fc2: Linear  # [proj_out_dim, proj_inner_dim]


@dataclass(frozen=True, slots=True)
class TauWeights:
    """Moondream 3's per-head q / v scaling (every layer)."""

    wq: Tensor  # [n_heads, qkv_dim]
    wv: Tensor  # [n_heads, qkv_dim]
    alpha: Tensor  # [n_heads]
    # derived, not in the checkpoint: [wq; wv], so both logits are one matmul
    wqv: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wqv", torch.cat([self.wq, self.wv]))


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """Moondream 3's routed GeGLU experts; no expert biases."""

    router: Linear  # [num_experts, dim]
    up: Tensor  # [num_experts, 2 * expert_inner_dim, dim]: rows [h; g]
    down: Tensor  # [num_experts, dim, expert_inner_dim]
    # FP8 experts (``moondream.fp8``): up / down are float8_e4m3fn and these their float32
    # per-output-row scales [num_experts, 2 * inner] / [num_experts, dim]; None: plain floats.
    up_scale: Tensor | None = None
    down_scale: Tensor | None = None
    # derived, not in the checkpoint: arange(num_experts) on the router's device (int64), the
    # ids the grouped MoE finds each expert's offset for, made once here rather than per call
    expert_ids: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ids = torch.arange(self.up.shape[0], device=self.router.weight.device)
        object.__setattr__(self, "expert_ids", ids)

    @property
    def fp8(self) -> bool:
        return self.up_scale is not None


@dataclass(frozen=True, slots=True)
class TextBlock:
    """One decoder block: a dense MLP (fc1 / fc2) or, in Moondream 3's MoE layers, ``moe``."""

    ln: LayerNorm
    qkv: Linear
    proj: Linear
    fc1: Linear | None
    fc2: Linear | None
    tau: TauWeights | None = None
    moe: MoeWeights | None = None


@dataclass(frozen=True, slots=True)
class TextWeights:
    wte: Tensor  # [vocab, dim]
    blocks: tuple[TextBlock, ...]
    post_ln: LayerNorm
    lm_head: Linear  # [vocab, dim]


@dataclass(frozen=True, slots=True)
class RegionWeights:
    coord_features: Tensor  # [1, coord_feat_dim / 2]
    coord_encoder: Linear
    size_features: Tensor  # [2, size_feat_dim / 2]
    size_encoder: Linear
    coord_fc1: Linear | None = None  # Moondream 2: the decoders are MLPs fc1 -> GELU -> fc2
    coord_fc2: Linear | None = None  # -> coord bins
    size_fc1: Linear | None = None
    size_fc2: Linear | None = None  # -> 2 * size bins
    coord_decoder: Linear | None = None  # Moondream 3: one Linear -> coord bins
    size_decoder: Linear | None = None  # Moondream 3: one Linear -> 2 * size bins
    ln: LayerNorm | None = None  # Moondream 3 files with region_model.ln: before both decoders

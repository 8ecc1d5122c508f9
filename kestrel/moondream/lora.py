"""LoRA adapters for the Moondream 2 / 3 text decoder (the reference's "variants").

An adapter holds, for every text layer, a low-rank pair (A [r, in], B [out, r]) for each of
``attn.qkv``, ``attn.proj``, ``mlp.fc1`` and ``mlp.fc2``. On Moondream 3 the MLP pairs of the
mixture-of-experts layers (``>= text.moe.start_layer``) are optional and never applied, as the
first-party reference ignores them there: they are neither shape-checked nor kept (``fc1`` /
``fc2`` are None), though they count in the digest. The delta is ``(x @ A.T) @ B.T`` added to
the base linear's output, with no alpha/rank scaling (any scale is folded into B).

Inputs, as the reference computes them (reproduced for parity):
- qkv, fc1 and proj LoRA read the block's LayerNorm output. For proj this is a reference quirk
  (it does not read the attention output) that adapters were trained and served with.
- fc2 LoRA reads GELU(fc1 output including its LoRA delta).
Adapters touch the text decoder only (image-prefix prefill included), never vision or region.

Two file formats load to the same adapter (same tensors, same digest):
- ``final.pt`` (reference variant format): a flat ``torch.save`` dict with training names such as
  ``text_model.transformer.h.0.mixer.Wqkv.parametrizations.weight.0.A``;
- ``adapter.safetensors``: normalized names ``text.blocks.<i>.<module>.{A,B}``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kestrel.moondream.config import MoondreamConfig

__all__ = [
    "LORA_MODULES",
    "LoraAdapter",
    "LoraFormatError",
    "LoraLayer",
    "LoraPair",
    "load_adapter",
    "normalize_lora_name",
]

LORA_MODULES = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")

# Substring renames of the reference loader (training names -> native module paths), in order.
_RENAMES = (
    ("text_model.transformer.h", "text.blocks"),
    (".mixer", ".attn"),
    (".out_proj", ".proj"),
    (".Wqkv", ".qkv"),
    (".parametrizations.weight.0", ""),
)
_NAME_RE = re.compile(r"^text\.blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.(A|B)$")


class LoraFormatError(ValueError):
    """An adapter file that does not describe a LoRA for this model."""


@dataclass(frozen=True, slots=True)
class LoraPair:
    A: Tensor  # [rank, in_features]
    B: Tensor  # [out_features, rank]


@dataclass(frozen=True, slots=True)
class LoraLayer:
    qkv: LoraPair
    proj: LoraPair
    fc1: LoraPair | None  # None in a Moondream 3 MoE layer (its MLP takes no LoRA)
    fc2: LoraPair | None


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A loaded adapter. ``lora_id`` (name + weight digest) keys the prefix-cache namespace."""

    name: str
    rank: int
    layers: tuple[LoraLayer, ...]
    digest: str  # sha256 hex over the source tensors (names, shapes, dtype, bytes)

    @property
    def lora_id(self) -> str:
        return f"{self.name}@{self.digest[:16]}"

    @classmethod
    def from_tensors(
        cls,
        name: str,
        tensors: Mapping[str, Tensor],
        config: MoondreamConfig,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> LoraAdapter:
        """Validate normalized-name tensors, digest them, then move/cast them for use."""
        rank = _validate(tensors, config)
        digest = _digest(tensors)
        layers = []
        for i in range(config.text.n_layers):
            pairs: dict[str, LoraPair | None] = {}
            for module in _applied_modules(config, i):
                a = tensors[f"text.blocks.{i}.{module}.A"].to(device=device, dtype=dtype)
                b = tensors[f"text.blocks.{i}.{module}.B"].to(device=device, dtype=dtype)
                pairs[module.split(".")[1]] = LoraPair(a.contiguous(), b.contiguous())
            layers.append(LoraLayer(**{"fc1": None, "fc2": None, **pairs}))
        return cls(name=name, rank=rank, layers=tuple(layers), digest=digest)


def normalize_lora_name(key: str) -> str:
    """Map a reference training name to ``text.blocks.<i>.<module>.{A,B}`` (substring renames)."""
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def _applied_modules(config: MoondreamConfig, layer: int) -> tuple[str, ...]:
    """The modules whose pairs layer ``layer`` applies (attention only in an MoE layer)."""
    return LORA_MODULES[:2] if config.text.is_moe_layer(layer) else LORA_MODULES


def _module_shapes(config: MoondreamConfig) -> dict[str, tuple[int, int]]:
    t = config.text
    return {
        "attn.qkv": (t.dim, t.qkv_dim),
        "attn.proj": (t.dim, t.dim),
        "mlp.fc1": (t.dim, t.ff_dim),
        "mlp.fc2": (t.ff_dim, t.dim),
    }


def _validate(tensors: Mapping[str, Tensor], config: MoondreamConfig) -> int:
    """Check names, completeness and shapes; return the rank."""
    unknown = sorted(k for k in tensors if not _NAME_RE.match(k))
    if unknown:
        raise LoraFormatError(
            f"adapter has unknown key(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; "
            "expected text.blocks.<i>.{attn.qkv,attn.proj,mlp.fc1,mlp.fc2}.{A,B}"
        )
    n_layers = config.text.n_layers
    bad_layers = sorted({int(_NAME_RE.match(k).group(1)) for k in tensors} - set(range(n_layers)))
    if bad_layers:
        raise LoraFormatError(
            f"adapter has layer(s) {bad_layers}, the model has {n_layers} text layers"
        )
    shapes = _module_shapes(config)
    missing = [
        f"text.blocks.{i}.{m}.{ab}"
        for i in range(n_layers)
        for m in _applied_modules(config, i)
        for ab in "AB"
        if f"text.blocks.{i}.{m}.{ab}" not in tensors
    ]
    if missing:
        moe = config.text.moe
        moe_note = "" if moe is None else f" (mlp only below layer {moe.start_layer})"
        raise LoraFormatError(
            f"adapter lacks {len(missing)} tensor(s), first {missing[:4]}: every text layer needs "
            f"A and B for attn.qkv, attn.proj, mlp.fc1 and mlp.fc2{moe_note}"
        )
    rank = int(tensors["text.blocks.0.attn.qkv.A"].shape[0])
    for i in range(n_layers):
        for m in _applied_modules(config, i):
            n_in, n_out = shapes[m]
            a = tensors[f"text.blocks.{i}.{m}.A"]
            b = tensors[f"text.blocks.{i}.{m}.B"]
            if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
                raise LoraFormatError(
                    f"text.blocks.{i}.{m}: A {list(a.shape)} / B {list(b.shape)}, expected "
                    f"A [{rank}, {n_in}] and B [{n_out}, {rank}] (rank {rank})"
                )
            if not (a.is_floating_point() and b.is_floating_point()):
                raise LoraFormatError(f"text.blocks.{i}.{m}: A and B must be floating point")
    return rank


def _digest(tensors: Mapping[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{list(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _read_file(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path), device="cpu"))
    try:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a bad pickle
        raise LoraFormatError(f"cannot read adapter file {path}: {exc}") from exc
    if not isinstance(raw, Mapping) or not all(isinstance(v, Tensor) for v in raw.values()):
        raise LoraFormatError(f"{path} must hold a flat dict of name -> tensor")
    return {normalize_lora_name(str(k)): v for k, v in raw.items()}


def _find_file(path: Path) -> Path:
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in ("adapter.safetensors", "final.pt"):
            if (path / candidate).is_file():
                return path / candidate
        raise LoraFormatError(f"{path} holds neither adapter.safetensors nor final.pt")
    raise FileNotFoundError(f"adapter path {path} does not exist")


def load_adapter(
    path: str | Path,
    config: MoondreamConfig,
    *,
    name: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """Load an adapter file (``.safetensors`` or reference ``final.pt``) or a directory holding
    one. ``name`` defaults to the directory name (the reference's variant id). ``dtype`` should
    be the model's dtype; None keeps the file's dtype.
    """
    file = _find_file(Path(path))
    tensors = _read_file(file)
    if name is None:
        name = file.parent.name if file.stem in ("final", "adapter") else file.stem
    return LoraAdapter.from_tensors(name, tensors, config, device=device, dtype=dtype)

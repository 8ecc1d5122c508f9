"""Moondream 2 and 3 weights built from a state dict, and the model object that holds them.

The containers themselves (``Linear``, ``TextBlock``, ...) are in ``containers.py``; they are
re-exported here.

Weights are data, compute is functions: ``vision.py``, ``text.py`` and ``region.py`` take these
frozen containers as arguments. ``MoondreamModel`` bundles the config, the three towers, the
device and the dtype; it never runs anything itself.

State-dict names are the native checkpoint names WITHOUT the ``model.`` prefix (the loader strips
it): ``vision.blocks.{i}.attn.qkv.weight``, ``text.wte``, ``region.coord_features``, ...
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.containers import (
    LayerNorm,
    Linear,
    MoeWeights,
    RegionWeights,
    TauWeights,
    TextBlock,
    TextWeights,
    VisionBlock,
    VisionWeights,
)

__all__ = [
    "LayerNorm",
    "Linear",
    "MissingWeightError",
    "MoeWeights",
    "MoondreamModel",
    "RegionWeights",
    "TauWeights",
    "TextBlock",
    "TextWeights",
    "VisionBlock",
    "VisionWeights",
]


class MissingWeightError(KeyError):
    """A tensor the model needs is absent from the state dict, or has the wrong shape."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class _Reader:
    """Pulls tensors out of a state dict, checking shapes against the config."""

    def __init__(self, sd: Mapping[str, Tensor]) -> None:
        self.sd = sd
        self.used: set[str] = set()

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.sd:
            raise MissingWeightError(
                f"checkpoint lacks tensor '{name}' (expected shape {list(shape)}); "
                "is this a Moondream 2 checkpoint matching its config.json?"
            )
        t = self.sd[name]
        if tuple(t.shape) != shape:
            raise MissingWeightError(
                f"tensor '{name}' has shape {list(t.shape)}, the config expects {list(shape)}"
            )
        self.used.add(name)
        return t

    def linear(self, prefix: str, n_out: int, n_in: int) -> Linear:
        return Linear(
            self.get(f"{prefix}.weight", (n_out, n_in)), self.get(f"{prefix}.bias", (n_out,))
        )

    def ln(self, prefix: str, dim: int) -> LayerNorm:
        return LayerNorm(self.get(f"{prefix}.weight", (dim,)), self.get(f"{prefix}.bias", (dim,)))


def _vision_weights(r: _Reader, cfg: MoondreamConfig) -> VisionWeights:
    v = cfg.vision
    c = v.enc_dim
    blocks = []
    for i in range(v.enc_n_layers):
        p = f"vision.blocks.{i}"
        blocks.append(
            VisionBlock(
                ln1=r.ln(f"{p}.ln1", c),
                qkv=r.linear(f"{p}.attn.qkv", 3 * c, c),
                proj=r.linear(f"{p}.attn.proj", c, c),
                ln2=r.ln(f"{p}.ln2", c),
                fc1=r.linear(f"{p}.mlp.fc1", v.enc_ff_dim, c),
                fc2=r.linear(f"{p}.mlp.fc2", c, v.enc_ff_dim),
            )
        )
    return VisionWeights(
        patch_emb=r.linear("vision.patch_emb", c, v.patch_dim),
        pos_emb=r.get("vision.pos_emb", (1, v.n_patches, c)),
        blocks=tuple(blocks),
        post_ln=r.ln("vision.post_ln", c),
        proj_fc1=r.linear("vision.proj_mlp.fc1", v.proj_inner_dim, 2 * c),
        proj_fc2=r.linear("vision.proj_mlp.fc2", v.proj_out_dim, v.proj_inner_dim),
    )


def _tau_weights(r: _Reader, p: str, cfg: MoondreamConfig) -> TauWeights | None:
    t = cfg.text
    if t.moe is None:
        return None
    return TauWeights(
        wq=r.get(f"{p}.attn.tau.wq", (t.n_heads, t.qkv_dim)),
        wv=r.get(f"{p}.attn.tau.wv", (t.n_heads, t.qkv_dim)),
        alpha=r.get(f"{p}.attn.tau.alpha", (t.n_heads,)),
    )


def _text_block(r: _Reader, i: int, cfg: MoondreamConfig) -> TextBlock:
    t, p = cfg.text, f"text.blocks.{i}"
    fc1 = fc2 = moe = None
    if t.is_moe_layer(i):
        assert t.moe is not None
        e, inner = t.moe.num_experts, t.moe.expert_inner_dim
        scaled = f"{p}.mlp.fc1.scale" in r.sd  # FP8 experts carry their row scales
        moe = MoeWeights(
            router=r.linear(f"{p}.mlp.router", e, t.dim),
            up=r.get(f"{p}.mlp.fc1.weight", (e, 2 * inner, t.dim)),
            down=r.get(f"{p}.mlp.fc2.weight", (e, t.dim, inner)),
            up_scale=r.get(f"{p}.mlp.fc1.scale", (e, 2 * inner)) if scaled else None,
            down_scale=r.get(f"{p}.mlp.fc2.scale", (e, t.dim)) if scaled else None,
        )
    else:
        fc1 = r.linear(f"{p}.mlp.fc1", t.ff_dim, t.dim)
        fc2 = r.linear(f"{p}.mlp.fc2", t.dim, t.ff_dim)
    return TextBlock(
        ln=r.ln(f"{p}.ln", t.dim),
        qkv=r.linear(f"{p}.attn.qkv", t.qkv_dim, t.dim),
        proj=r.linear(f"{p}.attn.proj", t.dim, t.dim),
        fc1=fc1,
        fc2=fc2,
        tau=_tau_weights(r, p, cfg),
        moe=moe,
    )


def _text_weights(r: _Reader, cfg: MoondreamConfig) -> TextWeights:
    t = cfg.text
    blocks = [_text_block(r, i, cfg) for i in range(t.n_layers)]
    return TextWeights(
        wte=r.get("text.wte", (t.vocab_size, t.dim)),
        blocks=tuple(blocks),
        post_ln=r.ln("text.post_ln", t.dim),
        lm_head=r.linear("text.lm_head", t.vocab_size, t.dim),
    )


def _region_weights(r: _Reader, cfg: MoondreamConfig) -> RegionWeights:
    g = cfg.region
    if g.inner_dim is None:  # Moondream 3: single-Linear decoders
        decoders = {
            "coord_decoder": r.linear("region.coord_decoder", g.coord_out_dim, g.dim),
            "size_decoder": r.linear("region.size_decoder", g.size_out_dim, g.dim),
        }
    else:
        decoders = {
            "coord_fc1": r.linear("region.coord_decoder.fc1", g.inner_dim, g.dim),
            "coord_fc2": r.linear("region.coord_decoder.fc2", g.coord_out_dim, g.inner_dim),
            "size_fc1": r.linear("region.size_decoder.fc1", g.inner_dim, g.dim),
            "size_fc2": r.linear("region.size_decoder.fc2", g.size_out_dim, g.inner_dim),
        }
    return RegionWeights(
        coord_features=r.get("region.coord_features", (1, g.coord_feat_dim // 2)),
        coord_encoder=r.linear("region.coord_encoder", g.dim, g.coord_feat_dim),
        size_features=r.get("region.size_features", (2, g.size_feat_dim // 2)),
        size_encoder=r.linear("region.size_encoder", g.dim, g.size_feat_dim),
        ln=r.ln("region.ln", g.dim) if "region.ln.weight" in r.sd else None,
        **decoders,
    )


def _count(obj: object) -> int:
    """Number of parameters in a (nested) weight container."""
    if isinstance(obj, Tensor):
        return obj.numel()
    if isinstance(obj, tuple):
        return sum(_count(o) for o in obj)
    if obj is None:
        return 0
    return sum(_count(getattr(obj, f.name)) for f in fields(obj) if f.init)  # type: ignore[arg-type]


def _default_dtype(device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """float32 on CPU, bfloat16 on CUDA (weights and so the KV pool: what FlashAttention takes,
    and half the bytes per decode step), the checkpoint's own dtype on other accelerators."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" else checkpoint_dtype


@dataclass(frozen=True, slots=True)
class MoondreamModel:
    """Config + the three weight towers. All tensors share one device and one dtype."""

    config: MoondreamConfig
    vision: VisionWeights
    text: TextWeights
    region: RegionWeights

    @property
    def device(self) -> torch.device:
        return self.text.wte.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.wte.dtype

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Tensor], config: MoondreamConfig) -> MoondreamModel:
        """Wrap the tensors of ``sd`` (native names, no ``model.`` prefix) without copying.

        Raises MissingWeightError naming the first absent or mis-shaped tensor. Unknown extra
        keys are ignored, as the reference does (it loads with strict=False).
        """
        r = _Reader(sd)
        model = cls(
            config=config,
            vision=_vision_weights(r, config),
            text=_text_weights(r, config),
            region=_region_weights(r, config),
        )
        dtypes = {sd[n].dtype for n in r.used if not _fp8_part(n, sd)}
        devices = {sd[n].device for n in r.used}
        if len(dtypes) != 1 or len(devices) != 1:
            raise MissingWeightError(
                f"state dict mixes dtypes {sorted(map(str, dtypes))} / devices "
                f"{sorted(map(str, devices))}; load it with one dtype and device"
            )
        return model

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        revision: str | None = None,
        moe_weights: str | None = None,
    ) -> MoondreamModel:
        """Load a checkpoint directory (or hub name) through ``kestrel.moondream.weights``.

        ``dtype=None`` picks float32 on CPU, bfloat16 on CUDA, else the checkpoint's dtype.
        ``moe_weights``: Moondream 3's experts in memory, ``"fp8"`` or ``"dequantize"`` (None:
        as the file holds them; ``load_state_dict`` says more).
        """
        import kestrel.moondream.weights as loader

        loader.check_moe_weights(moe_weights)
        device = torch.device(device)
        ckpt = loader.resolve_checkpoint(
            name_or_path, revision=revision, prefer_fp8=moe_weights == "fp8"
        )
        config = loader.load_config(ckpt)
        if dtype is None:  # decided from the header, so each tensor is cast once while loading
            dtype = _default_dtype(device, loader.checkpoint_dtype(ckpt))
        sd = loader.load_state_dict(
            ckpt, config, device=device, dtype=dtype, moe_weights=moe_weights
        )
        return cls.from_state_dict(sd, config)

    def to(self, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        """A copy of the model with every tensor moved / cast (used for the bf16 check)."""
        sd = self.state_dict()
        sd = {
            k: v.to(device=device, dtype=None if _fp8_part(k, sd) else dtype) for k, v in sd.items()
        }
        return MoondreamModel.from_state_dict(sd, self.config)

    def state_dict(self) -> dict[str, Tensor]:
        """Native-name state dict (no ``model.`` prefix) of the weights held."""
        out: dict[str, Tensor] = {}
        _flatten_into(out, "vision", self.vision)
        _flatten_into(out, "text", self.text)
        _flatten_into(out, "region", self.region)
        return out

    def parameter_counts(self) -> dict[str, int]:
        """Parameters per tower plus ``total``."""
        counts = {
            "vision": _count(self.vision),
            "text": _count(self.text),
            "region": _count(self.region),
        }
        counts["total"] = sum(counts.values())
        return counts


def _fp8_part(name: str, sd: Mapping[str, Tensor]) -> bool:
    """An FP8 expert stack or its scales: kept in their own dtypes whatever the model's."""
    if name.endswith(".scale"):
        return True
    return name.endswith(("mlp.fc1.weight", "mlp.fc2.weight")) and (
        name.rsplit(".", 1)[0] + ".scale" in sd
    )


# Container field -> checkpoint name piece (where they differ).
_NATIVE = {
    "qkv": "attn.qkv",
    "proj": "attn.proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
    "proj_fc1": "proj_mlp.fc1",
    "proj_fc2": "proj_mlp.fc2",
    "coord_fc1": "coord_decoder.fc1",
    "coord_fc2": "coord_decoder.fc2",
    "size_fc1": "size_decoder.fc1",
    "size_fc2": "size_decoder.fc2",
    "tau": "attn.tau",
    "moe": "mlp",
    "up": "fc1.weight",
    "down": "fc2.weight",
    "up_scale": "fc1.scale",
    "down_scale": "fc2.scale",
}


def _flatten_into(out: dict[str, Tensor], prefix: str, obj: object) -> None:
    if isinstance(obj, Tensor):
        out[prefix] = obj
        return
    if obj is None:
        return
    if isinstance(obj, tuple):
        for i, o in enumerate(obj):
            _flatten_into(out, f"{prefix}.{i}", o)
        return
    for f in fields(obj):  # type: ignore[arg-type]
        if f.init:  # derived fields are not weights of the checkpoint
            _flatten_into(out, f"{prefix}.{_NATIVE.get(f.name, f.name)}", getattr(obj, f.name))

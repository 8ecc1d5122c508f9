"""Checkpoint key layouts of Moondream 2 and 3: every native tensor name with its shape, and
the legacy (training-time) name of each.

Native names are the reference's module paths without the ``model.`` prefix. Moondream 3 adds
per block ``attn.tau.{wq,wv,alpha}`` and, in MoE layers, ``mlp.router.*`` with the stacked
experts ``mlp.fc1.weight`` [E, 2 * inner, dim] / ``mlp.fc2.weight`` [E, dim, inner]; its region
decoders are single Linears (``region.coord_decoder.*``). Legacy names: ``tau_wq``, ``gate``,
``mlp.experts`` / ``mlp.output_experts``, ``region_model.coordinate_head`` / ``size_head``.
"""

from __future__ import annotations

import re

from .config import MoondreamConfig

__all__ = ["expected_shapes", "fp8_scale_shapes", "region_ln_shapes", "tau_fused_name"]

# Tensors the legacy layout stores transposed relative to the native one.
_TRANSPOSED_IN_LEGACY = frozenset({"region.coord_features", "region.size_features"})


def _linear(prefix: str, out_f: int, in_f: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (out_f, in_f), f"{prefix}.bias": (out_f,)}


def _norm(prefix: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (dim,), f"{prefix}.bias": (dim,)}


def expected_shapes(config: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the native layout (no ``model.`` prefix) and its shape, in load order."""
    v, t, r = config.vision, config.text, config.region
    shapes: dict[str, tuple[int, ...]] = {}
    shapes.update(_linear("vision.patch_emb", v.enc_dim, v.patch_dim))
    shapes["vision.pos_emb"] = (1, v.n_patches, v.enc_dim)
    for i in range(v.enc_n_layers):
        b = f"vision.blocks.{i}"
        shapes.update(_norm(f"{b}.ln1", v.enc_dim))
        shapes.update(_linear(f"{b}.attn.qkv", 3 * v.enc_dim, v.enc_dim))
        shapes.update(_linear(f"{b}.attn.proj", v.enc_dim, v.enc_dim))
        shapes.update(_norm(f"{b}.ln2", v.enc_dim))
        shapes.update(_linear(f"{b}.mlp.fc1", v.enc_ff_dim, v.enc_dim))
        shapes.update(_linear(f"{b}.mlp.fc2", v.enc_dim, v.enc_ff_dim))
    shapes.update(_norm("vision.post_ln", v.enc_dim))
    # The projection reads [global features, pooled local features]: twice the encoder width.
    shapes.update(_linear("vision.proj_mlp.fc1", v.proj_inner_dim, 2 * v.enc_dim))
    shapes.update(_linear("vision.proj_mlp.fc2", v.proj_out_dim, v.proj_inner_dim))

    shapes["text.wte"] = (t.vocab_size, t.dim)
    for i in range(t.n_layers):
        shapes.update(_text_block_shapes(config, i))
    shapes.update(_norm("text.post_ln", t.dim))
    shapes.update(_linear("text.lm_head", t.vocab_size, t.dim))

    # Fourier features: cos and sin halves are concatenated, so the matrices are half-width.
    shapes["region.coord_features"] = (1, r.coord_feat_dim // 2)
    shapes.update(_linear("region.coord_encoder", r.dim, r.coord_feat_dim))
    shapes.update(_region_decoder("region.coord_decoder", r.coord_out_dim, config))
    shapes["region.size_features"] = (2, r.size_feat_dim // 2)
    shapes.update(_linear("region.size_encoder", r.dim, r.size_feat_dim))
    shapes.update(_region_decoder("region.size_decoder", r.size_out_dim, config))
    return shapes


def _text_block_shapes(config: MoondreamConfig, i: int) -> dict[str, tuple[int, ...]]:
    t, b = config.text, f"text.blocks.{i}"
    shapes = {**_norm(f"{b}.ln", t.dim), **_linear(f"{b}.attn.qkv", t.qkv_dim, t.dim)}
    shapes.update(_linear(f"{b}.attn.proj", t.dim, t.dim))
    if t.moe is not None:  # Moondream 3: tau on every layer
        shapes[f"{b}.attn.tau.wq"] = shapes[f"{b}.attn.tau.wv"] = (t.n_heads, t.qkv_dim)
        shapes[f"{b}.attn.tau.alpha"] = (t.n_heads,)
    if t.is_moe_layer(i):
        assert t.moe is not None
        e, inner = t.moe.num_experts, t.moe.expert_inner_dim
        shapes.update(_linear(f"{b}.mlp.router", e, t.dim))
        shapes[f"{b}.mlp.fc1.weight"] = (e, 2 * inner, t.dim)
        shapes[f"{b}.mlp.fc2.weight"] = (e, t.dim, inner)
    else:
        shapes.update(_linear(f"{b}.mlp.fc1", t.ff_dim, t.dim))
        shapes.update(_linear(f"{b}.mlp.fc2", t.dim, t.ff_dim))
    return shapes


def fp8_scale_shapes(config: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """The row scales of FP8 experts, per MoE layer: ``mlp.fc1.scale`` [E, 2 * inner] and
    ``mlp.fc2.scale`` [E, dim] (legacy: ``moe_quant.up_scale`` / ``down_scale``)."""
    t, shapes = config.text, {}
    for i in range(t.n_layers):
        if t.is_moe_layer(i):
            assert t.moe is not None
            e, inner = t.moe.num_experts, t.moe.expert_inner_dim
            shapes[f"text.blocks.{i}.mlp.fc1.scale"] = (e, 2 * inner)
            shapes[f"text.blocks.{i}.mlp.fc2.scale"] = (e, t.dim)
    return shapes


def region_ln_shapes(config: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """The optional LayerNorm before Moondream 3's region decoders (``region_model.ln``)."""
    return _norm("region.ln", config.region.dim)


_TAU_PART = re.compile(r"^text\.blocks\.(\d+)\.attn\.tau\.(wq|wv)$")


def tau_fused_name(native: str) -> tuple[str, int] | None:
    """For ``text.blocks.N.attn.tau.wq`` / ``wv``: the legacy fused tensor ``tau_wqwv``
    (= concat(wq, wv) along the heads) and which half (0: wq, 1: wv); None for other names."""
    m = _TAU_PART.match(native)
    if m is None:
        return None
    return f"text_model.transformer.h.{m.group(1)}.tau_wqwv", 0 if m.group(2) == "wq" else 1


def _region_decoder(prefix: str, n_out: int, config: MoondreamConfig) -> dict:
    r = config.region
    if r.inner_dim is None:  # Moondream 3: one Linear
        return _linear(prefix, n_out, r.dim)
    return {
        **_linear(f"{prefix}.fc1", r.inner_dim, r.dim),
        **_linear(f"{prefix}.fc2", n_out, r.inner_dim),
    }


# Native name -> legacy name, applied in order (first match wins; \1 keeps block indices).
_LEGACY_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), repl)
    for pattern, repl in (
        (r"^vision\.patch_emb\.", "vision_encoder.encoder.model.visual.patch_embed.linear."),
        (r"^vision\.pos_emb$", "vision_encoder.encoder.model.visual.pos_embed"),
        (r"^vision\.post_ln\.", "vision_encoder.encoder.model.visual.norm."),
        (r"^vision\.blocks\.(\d+)\.ln1\.", r"vision_encoder.encoder.model.visual.blocks.\1.norm1."),
        (r"^vision\.blocks\.(\d+)\.ln2\.", r"vision_encoder.encoder.model.visual.blocks.\1.norm2."),
        (r"^vision\.blocks\.", "vision_encoder.encoder.model.visual.blocks."),
        (r"^vision\.proj_mlp\.", "vision_encoder.projection.mlp."),
        (r"^text\.wte$", "text_model.transformer.embd.wte.weight"),
        (r"^text\.blocks\.(\d+)\.attn\.qkv\.", r"text_model.transformer.h.\1.mixer.Wqkv."),
        (r"^text\.blocks\.(\d+)\.attn\.proj\.", r"text_model.transformer.h.\1.mixer.out_proj."),
        # Moondream 3: tau, router (gate) and the stacked experts
        (r"^text\.blocks\.(\d+)\.attn\.tau\.(wq|wv|alpha)$", r"text_model.transformer.h.\1.tau_\2"),
        (r"^text\.blocks\.(\d+)\.mlp\.router\.", r"text_model.transformer.h.\1.gate."),
        (
            r"^text\.blocks\.(\d+)\.mlp\.fc1\.scale$",
            r"text_model.transformer.h.\1.moe_quant.up_scale",
        ),
        (
            r"^text\.blocks\.(\d+)\.mlp\.fc2\.scale$",
            r"text_model.transformer.h.\1.moe_quant.down_scale",
        ),
        (r"^text\.blocks\.", "text_model.transformer.h."),
        (r"^text\.post_ln\.", "text_model.lm_head.ln."),
        (r"^text\.lm_head\.", "text_model.lm_head.linear."),
        (r"^region\.coord_decoder\.(weight|bias)$", r"region_model.coordinate_head.\1"),
        (r"^region\.size_decoder\.(weight|bias)$", r"region_model.size_head.\1"),
        (r"^region\.coord_features$", "region_model.coordinate_features.weight"),
        (r"^region\.size_features$", "region_model.size_features.weight"),
        (r"^region\.coord_", "region_model.coordinate_"),
        (r"^region\.", "region_model."),
    )
)


# Moondream 3's stacked experts (MoE layers only; dense layers keep mlp.fc1 / mlp.fc2).
_LEGACY_EXPERTS = re.compile(r"^text\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.weight$")
_EXPERT_NAMES = {"fc1": "experts", "fc2": "output_experts"}


def _legacy_name(native: str, config: MoondreamConfig | None = None) -> str:
    m = _LEGACY_EXPERTS.match(native)
    if m and config is not None and config.text.is_moe_layer(int(m.group(1))):
        return f"text_model.transformer.h.{m.group(1)}.mlp.{_EXPERT_NAMES[m.group(2)]}.weight"
    for pattern, repl in _LEGACY_RULES:
        if pattern.search(native):
            return pattern.sub(repl, native, count=1)
    raise AssertionError(f"no legacy name rule for {native}")  # expected_shapes is closed

"""Dense training forward: the inference functions and weights, without the paged KV cache.

``text.text_forward`` writes K/V into pages for serving; training needs gradients through a
whole packed batch instead. This module runs the very same block math (``layer_norm``,
``linear``, ``rope_cos_sin`` / ``apply_rope``, the parallel attention + MLP residual, LoRA deltas
with the proj-reads-LN-output quirk) over a dense [B, T] batch with an explicit attention mask,
and uses the vision and region functions unchanged. Both families: Moondream 3's tau scaling of
q and v and its MoE layers (the grouped ``moe_mlp``, differentiable) come from ``moondream.moe``
as in ``text_forward``, and an adapter's MLP entries do not apply to the MoE layers.

Packing: each row is ``BOS + image`` (one bidirectional block, positions 0..prefix_len-1)
followed by several independent segments (a prompt plus its answer), each starting at position
``prefix_len`` and seeing only the prefix and itself, causally. A segment is therefore computed
exactly as the eager path would compute that prompt after that image, while the image prefix
is encoded once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import MoondreamConfig, TextConfig
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel, TextBlock, TextWeights
from kestrel.moondream.moe import moe_mlp, tau_factors
from kestrel.moondream.region import decode_coordinate, decode_size, encode_coordinate, encode_size
from kestrel.moondream.rope import apply_rope, rope_cos_sin
from kestrel.moondream.text import dense_activation, embed_text, layer_norm, linear, lm_head
from kestrel.moondream.vision import pooled_local_features, vision_encoder, vision_projection
from kestrel.tokens import CoordToken, SizeToken, TextToken

__all__ = [
    "PackedBatch",
    "Segment",
    "dense_text_forward",
    "embed_packed",
    "image_embeddings",
    "pack",
    "packed_loss",
]

NO_TARGET = -1


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens fed after the image prefix, with per-token targets read from their hidden state:
    ``lm`` the next token id, ``coord`` a coordinate bin, ``size`` (width bin, height bin);
    NO_TARGET (or None for size) where that head is not trained."""

    tokens: tuple[TextToken | CoordToken | SizeToken, ...]
    lm: tuple[int, ...]
    coord: tuple[int, ...]
    size: tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """Index plans for one packed batch; slots are flat indices into [B * T]."""

    batch: int
    length: int
    positions: Tensor  # int64 [B, T]
    mask: Tensor  # bool [B, 1, T, T], True = may attend
    bos_slots: Tensor
    image_slots: Tensor  # [B * n_patches], row-major per image
    text_slots: Tensor
    text_ids: Tensor
    coord_slots: Tensor
    coord_values: Tensor  # float [Nc]
    size_slots: Tensor
    size_values: Tensor  # float [Ns, 2]
    lm_slots: Tensor
    lm_targets: Tensor
    coord_target_slots: Tensor
    coord_targets: Tensor
    size_target_slots: Tensor
    size_targets: Tensor  # int64 [n, 2]


def _segment_ids(rows: Sequence[Sequence[Segment]], prefix_len: int, length: int) -> Tensor:
    """-1 for the prefix, k for segment k, -2 for padding: [B, T]."""
    seg = torch.full((len(rows), length), -2, dtype=torch.int64)
    for b, segments in enumerate(rows):
        seg[b, :prefix_len] = -1
        pos = prefix_len
        for k, s in enumerate(segments):
            seg[b, pos : pos + len(s.tokens)] = k
            pos += len(s.tokens)
    return seg


def _mask(seg_BT: Tensor) -> Tensor:
    T = seg_BT.shape[1]
    idx = torch.arange(T)
    q, k = seg_BT[:, :, None], seg_BT[:, None, :]  # [B, T, 1], [B, 1, T]
    sees_prefix = (k == -1) & (q != -2)  # the prefix block is bidirectional
    same_segment = (q == k) & (q >= 0) & (idx[None, None, :] <= idx[None, :, None])
    return (sees_prefix | same_segment | torch.eye(T, dtype=torch.bool)[None])[:, None]


def pack(rows: Sequence[Sequence[Segment]], config: MoondreamConfig) -> PackedBatch:
    """Plan a batch: row b = BOS + image b + rows[b]'s segments, padded to the longest row."""
    P, n_img = config.prefix_len, config.image_tokens
    length = max(P + sum(len(s.tokens) for s in segs) for segs in rows)
    seg = _segment_ids(rows, P, length)
    positions = torch.zeros(len(rows), length, dtype=torch.int64)
    lists: dict[str, list] = {k: [] for k in ("ts", "ti", "cs", "cv", "ss", "sv", "ls", "lt")}
    lists.update({k: [] for k in ("cts", "ct", "sts", "st")})
    for b, segments in enumerate(rows):
        positions[b, :P] = torch.arange(P)
        col = P
        for s in segments:
            n = len(s.tokens)
            positions[b, col : col + n] = torch.arange(P, P + n)  # every segment restarts at P
            for t, tok, lm, co, sz in zip(range(n), s.tokens, s.lm, s.coord, s.size, strict=True):
                _plan_token(lists, b * length + col + t, tok, lm, co, sz)
            col += n

    def ints(key: str) -> Tensor:
        return torch.tensor(lists[key], dtype=torch.int64)

    return PackedBatch(
        batch=len(rows),
        length=length,
        positions=positions,
        mask=_mask(seg),
        bos_slots=torch.arange(len(rows)) * length,
        image_slots=(torch.arange(len(rows))[:, None] * length + 1 + torch.arange(n_img)).reshape(
            -1
        ),
        text_slots=ints("ts"),
        text_ids=ints("ti"),
        coord_slots=ints("cs"),
        coord_values=torch.tensor(lists["cv"], dtype=torch.float32),
        size_slots=ints("ss"),
        size_values=torch.tensor(lists["sv"], dtype=torch.float32).reshape(-1, 2),
        lm_slots=ints("ls"),
        lm_targets=ints("lt"),
        coord_target_slots=ints("cts"),
        coord_targets=ints("ct"),
        size_target_slots=ints("sts"),
        size_targets=torch.tensor(lists["st"], dtype=torch.int64).reshape(-1, 2),
    )


def _plan_token(lists: dict[str, list], slot: int, tok, lm: int, coord: int, size) -> None:
    if isinstance(tok, TextToken):
        lists["ts"].append(slot)
        lists["ti"].append(tok.token_id)
    elif isinstance(tok, CoordToken):
        lists["cs"].append(slot)
        lists["cv"].append(tok.pos)
    else:
        lists["ss"].append(slot)
        lists["sv"].append((tok.width, tok.height))
    if lm != NO_TARGET:
        lists["ls"].append(slot)
        lists["lt"].append(lm)
    if coord != NO_TARGET:
        lists["cts"].append(slot)
        lists["ct"].append(coord)
    if size is not None:
        lists["sts"].append(slot)
        lists["st"].append(size)


def image_embeddings(
    pixels: Sequence[Tensor], tilings: Sequence[tuple[int, int]], model: MoondreamModel
) -> Tensor:
    """Per image normalized crops [N_i, 3, S, S] -> image embeddings [n_images, n_patches, dim]:
    one encoder call over every crop, then the per-image stitch/pool and one projection call."""
    cfg, w = model.config.vision, model.vision
    features = vision_encoder(torch.cat(list(pixels)), w, cfg)  # [sum N_i, n_patches, enc_dim]
    proj_in, start = [], 0
    for crops, tiling in zip(pixels, tilings, strict=True):
        n = crops.shape[0]
        local = pooled_local_features(features[start + 1 : start + n], tiling, cfg)
        proj_in.append(torch.cat([features[start], local], dim=-1))  # global first
        start += n
    return vision_projection(torch.stack(proj_in), w)


def _lora(out: Tensor, x: Tensor, lora: LoraAdapter | None, layer: int, module: str) -> Tensor:
    if lora is None:
        return out
    pair = getattr(lora.layers[layer], module)
    return out + F.linear(F.linear(x, pair.A), pair.B)


def dense_text_forward(
    x_BTC: Tensor,
    w: TextWeights,
    cfg: TextConfig,
    *,
    positions_BT: Tensor,
    mask_B1TT: Tensor,
    lora: LoraAdapter | None = None,
) -> Tensor:
    """The decoder of ``text.text_forward`` over a dense batch; hidden states before post_ln."""
    B, T, C = x_BTC.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos_BTR, sin_BTR = rope_cos_sin(positions_BT, cfg.rotary_dim, cfg.rope_theta)
    x = x_BTC
    for i, blk in enumerate(w.blocks):
        h = layer_norm(x, blk.ln)
        qkv = _lora(linear(h, blk.qkv), h, lora, i, "qkv")  # [B, T, (H + 2Hkv) D]
        q, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
        if blk.tau is not None:  # Moondream 3: q and v (not k) scaled before rotary
            tau_q, tau_v = tau_factors(qkv, positions_BT, blk.tau)  # [B, T, H] each
            q = (q.view(B, T, H, D) * tau_q[..., None]).reshape(B, T, H * D)
            v = (v.view(B, T, Hkv, D) * tau_v[..., None]).reshape(B, T, Hkv * D)
        q = apply_rope(q.view(B, T, H, D), cos_BTR, sin_BTR).transpose(1, 2)  # [B, H, T, D]
        k = apply_rope(k.view(B, T, Hkv, D), cos_BTR, sin_BTR).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if Hkv != H:
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TT)  # [B, H, T, D]
        attn_out = _lora(
            linear(attn.transpose(1, 2).reshape(B, T, C), blk.proj), h, lora, i, "proj"
        )
        x = x + attn_out + _mlp(h, blk, cfg, lora, i)
    return x


def _mlp(h: Tensor, blk: TextBlock, cfg: TextConfig, lora: LoraAdapter | None, i: int) -> Tensor:
    """The dense MLP with its LoRA pairs, or Moondream 3's experts (no LoRA, as the runtime)."""
    if blk.moe is not None:
        assert cfg.moe is not None
        return moe_mlp(h, blk.moe, cfg.moe)[0]
    assert blk.fc1 is not None and blk.fc2 is not None
    ff = dense_activation(_lora(linear(h, blk.fc1), h, lora, i, "fc1"))
    return _lora(linear(ff, blk.fc2), ff, lora, i, "fc2")


def embed_packed(batch: PackedBatch, img_emb: Tensor, model: MoondreamModel, bos_id: int) -> Tensor:
    """Input embeddings [B, T, dim]: BOS, image rows, then text / coordinate / size tokens
    through the same embedders as inference (wte, encode_coordinate, encode_size)."""
    C = model.config.text.dim
    flat = torch.zeros(batch.batch * batch.length, C, dtype=model.dtype)
    bos = embed_text(torch.full((batch.batch,), bos_id), model.text)
    flat = flat.index_copy(0, batch.bos_slots, bos)
    flat = flat.index_copy(0, batch.image_slots, img_emb.reshape(-1, C))
    flat = flat.index_copy(0, batch.text_slots, embed_text(batch.text_ids, model.text))
    if batch.coord_slots.numel():
        flat = flat.index_copy(
            0, batch.coord_slots, encode_coordinate(batch.coord_values, model.region)
        )
    if batch.size_slots.numel():
        flat = flat.index_copy(0, batch.size_slots, encode_size(batch.size_values, model.region))
    return flat.view(batch.batch, batch.length, C)


def _soft_ce(logits: Tensor, target: Tensor, sigma: float) -> Tensor:
    """Cross-entropy against a Gaussian over neighbouring bins (sigma in bins; 0 = one-hot)."""
    if sigma <= 0:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    bins = torch.arange(logits.shape[-1], dtype=logits.dtype)
    soft = torch.exp(-0.5 * ((bins - target[..., None].to(logits.dtype)) / sigma) ** 2)
    soft = soft / soft.sum(-1, keepdim=True)
    return -(soft * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def packed_loss(
    model: MoondreamModel,
    batch: PackedBatch,
    img_emb: Tensor,
    *,
    lora: LoraAdapter | None = None,
    sigma: float = 0.0,
) -> dict[str, Tensor]:
    """LM, coordinate and size losses (and the LM/coord accuracy) of one packed batch."""
    x = embed_packed(batch, img_emb, model, model.config.tokenizer.bos_id)
    hidden = dense_text_forward(
        x,
        model.text,
        model.config.text,
        positions_BT=batch.positions,
        mask_B1TT=batch.mask,
        lora=lora,
    ).reshape(batch.batch * batch.length, -1)
    logits = lm_head(hidden[batch.lm_slots], model.text)
    out = {"lm": F.cross_entropy(logits, batch.lm_targets)}
    out["lm_acc"] = (logits.argmax(-1) == batch.lm_targets).float().mean()
    zero = hidden.sum() * 0.0
    out["coord"] = out["size"] = zero
    if batch.coord_targets.numel():
        c_logits = decode_coordinate(hidden[batch.coord_target_slots], model.region)
        out["coord"] = _soft_ce(c_logits, batch.coord_targets, sigma)
        err = (c_logits.argmax(-1) - batch.coord_targets).abs().float()
        out["coord_err"] = err.mean() / model.config.region.coord_bins
    if batch.size_targets.numel():
        s_logits = decode_size(hidden[batch.size_target_slots], model.region)
        out["size"] = _soft_ce(s_logits, batch.size_targets, sigma)
    out["loss"] = out["lm"] + out["coord"] + out["size"]
    return out

"""Moondream's vision tower, from an image's pixels to its image embeddings.

1. Overlapping crops: one global crop (the whole image squashed to crop x crop) plus up to
   ``max_crops`` local crops cut from an upscaled copy, byte-identical to the reference's. They
   are made outside the model, by the crop wing (``kestrel/crops/``), which hands this module
   the crops and their tiling (rows, cols): all the model needs to reassemble the local crops'
   features (step 4, with its own ``grid_side`` and ``overlap_margin``). Pixel normalization
   (here) reproduces the reference's bfloat16 arithmetic whatever the model dtype; it maps each
   of the 256 pixel values to one number (``pixel_table``).
2. patchify: row-major patches, each flattened channel-major (c, py, px);
3. encoder: patch_emb + pos_emb, pre-LN blocks with bidirectional attention, post_ln;
4. stitch the local tiles' features, dropping ``overlap_margin`` patches on interior edges,
   adaptive-average-pool the stitched grid to grid_side x grid_side;
5. projection MLP (tanh-GELU) over [global features | pooled local features].

``encode_image`` takes the normalized crops [N, 3, crop, crop] (index 0 = global crop, then the
local tiles in row-major order) and the tiling (rows, cols); it returns ``n_patches`` image
embeddings of the text width, which follow BOS (or the image's place) in the prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import VisionConfig
from kestrel.moondream.model import VisionBlock, VisionWeights
from kestrel.moondream.text import LN_EPS, layer_norm, linear
from kestrel_kernels.fused import add_layer_norm, linear_gelu

__all__ = [
    "VisionInputError",
    "VisionOutputs",
    "check_crops",
    "encode_image",
    "encode_image_with_intermediates",
    "normalize_pixels",
    "normalize_planar",
    "patchify",
    "pixel_table",
    "pooled_local_features",
    "vision_encoder",
    "vision_projection",
]


# ---------------------------------------------------------------------- normalization
# The crops themselves are made by the crop wing (kestrel/crops/, which imports this module,
# never the other way); normalization turns them into the encoder's input.
class VisionInputError(ValueError):
    """Crops the vision tower cannot take: not uint8 [N, H, W, 3] pixels, or a count or
    shape that does not match the tiling / config."""


def normalize_pixels(
    crops_u8: np.ndarray | torch.Tensor,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """uint8 crops [N, H, W, 3] -> [N, 3, H, W] in [-1, 1], cast to ``dtype`` on ``device``.

    The arithmetic is the reference's: uint8 -> bfloat16, then /255, -0.5, /0.5 with every step
    rounded to bfloat16, whatever ``dtype`` is; the 256 possible results are the fixture's
    ``pixel_lut``. The uint8 data moves to the device before widening (4x less to copy).
    """
    if isinstance(crops_u8, np.ndarray):
        # torch cannot wrap a read-only array (OverlapCrops.crops is one): copy the uint8 data.
        array = crops_u8 if crops_u8.flags.writeable else crops_u8.copy()
        crops = torch.from_numpy(array)
    else:
        crops = crops_u8
    if crops.dtype != torch.uint8 or crops.ndim != 4 or crops.shape[-1] != 3:
        raise VisionInputError(
            f"expected uint8 crops [N, H, W, 3], got {crops.dtype} {tuple(crops.shape)}"
        )
    x_NHWC = crops.to(device=device)
    x_NCHW = x_NHWC.permute(0, 3, 1, 2).contiguous()  # reordered as uint8: the fewest bytes
    return normalize_planar(x_NCHW, dtype)


def normalize_planar(x_NCHW: Tensor, dtype: torch.dtype) -> Tensor:
    """Pixel values 0..255 [N, 3, H, W] (uint8, or whole numbers in a float type) normalized as
    ``normalize_pixels`` does, in ``dtype`` (bfloat16 values are used as they are)."""
    x = x_NCHW if x_NCHW.dtype == torch.bfloat16 else x_NCHW.to(torch.bfloat16)
    x = x.div(255.0).sub(0.5).div(0.5)
    return x if dtype == torch.bfloat16 else x.to(dtype)


def pixel_table() -> np.ndarray:
    """The 256 values ``normalize_pixels`` maps the pixel values 0..255 to, as float32 (each is
    a bfloat16 number, so float32 and every model dtype hold it exactly as it is)."""
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 256, 1).expand(1, 1, 256, 3)
    return normalize_pixels(levels.contiguous(), torch.float32)[0, 0, 0].numpy().copy()


# ---------------------------------------------------------------------- the encoder
@dataclass(frozen=True, slots=True)
class VisionOutputs:
    features: Tensor  # [N, n_patches, enc_dim], encoder output after post_ln
    proj_input: Tensor  # [n_patches, 2 * enc_dim], [global | pooled local]
    img_emb: Tensor  # [n_patches, proj_out_dim]


def patchify(pixels_NCHW: Tensor, patch: int) -> Tensor:
    """[N, C, S, S] -> [N, (S/p)^2, C*p*p].

    Patch n = gy * (S/p) + gx; vector index c*p*p + py*p + px (channel-major)."""
    N, C, S, _ = pixels_NCHW.shape
    g = S // patch
    x = pixels_NCHW.reshape(N, C, g, patch, g, patch)  # [N, C, gy, py, gx, px]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [N, gy, gx, C, py, px]
    return x.reshape(N, g * g, C * patch * patch)


def _attention(x_NPC: Tensor, blk: VisionBlock, n_heads: int) -> Tensor:
    N, P, C = x_NPC.shape
    D = C // n_heads
    qkv = linear(x_NPC, blk.qkv)  # [N, P, 3C]
    qkv = qkv.view(N, P, 3, n_heads, D).permute(2, 0, 3, 1, 4)  # [3, N, H, P, D]
    out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [N, H, P, D]
    out = out.transpose(1, 2).reshape(N, P, C)
    return linear(out, blk.proj)


def vision_encoder(pixels_NCHW: Tensor, w: VisionWeights, cfg: VisionConfig) -> Tensor:
    """Encoder features after post_ln: [N, n_patches, enc_dim]. Crops are independent."""
    x = linear(patchify(pixels_NCHW, cfg.enc_patch_size), w.patch_emb) + w.pos_emb
    # each residual add runs with the LayerNorm after it (one launch where fused)
    norms = [n for blk in w.blocks for n in (blk.ln1, blk.ln2)] + [w.post_ln]
    h = layer_norm(x, norms[0])
    for i, blk in enumerate(w.blocks):
        x, h = add_layer_norm(x, (_attention(h, blk, cfg.enc_n_heads),), *_ln(norms[2 * i + 1]))
        mlp = linear(linear_gelu(h, blk.fc1.weight, blk.fc1.bias), blk.fc2)
        x, h = add_layer_norm(x, (mlp,), *_ln(norms[2 * i + 2]))
    return h


def _ln(w) -> tuple[Tensor, Tensor, float]:
    return w.weight, w.bias, LN_EPS


def _keep_range(i: int, n: int, g: int, m: int) -> tuple[int, int]:
    """Rows (or cols) of tile i of n kept when stitching: margins drop on interior edges."""
    return (0 if i == 0 else m), (g if i == n - 1 else g - m)


@functools.lru_cache(maxsize=64)
def _stitch_index(rows: int, cols: int, g: int, m: int, device: torch.device) -> Tensor:
    """For every cell of the stitched grid, the row of ``local_TPC.reshape(-1, C)`` it comes
    from (each cell comes from exactly one tile), on ``device``: one gather stitches. Made
    outside inference mode, so the cached index also serves a training forward later."""
    win = g - 2 * m
    with torch.inference_mode(False):
        idx = torch.empty(win * rows + 2 * m, win * cols + 2 * m, dtype=torch.int64)
        cell = torch.arange(rows * cols * g * g).view(rows, cols, g, g)
        for i in range(rows):
            ys, ye = _keep_range(i, rows, g, m)
            for j in range(cols):
                xs, xe = _keep_range(j, cols, g, m)
                idx[win * i + ys : win * i + ye, win * j + xs : win * j + xe] = cell[
                    i, j, ys:ye, xs:xe
                ]
        return idx.reshape(-1).to(device)


def pooled_local_features(local_TPC: Tensor, tiling: tuple[int, int], cfg: VisionConfig) -> Tensor:
    """Stitch the local tiles' features and pool them to the patch grid: -> [n_patches, C].

    Output grid before pooling: (window * rows + 2m) x (window * cols + 2m) patches with
    window = grid_side - 2m; every output cell comes from exactly one tile (one gather).
    """
    rows, cols = tiling
    g, m = cfg.grid_side, cfg.overlap_margin
    win = g - 2 * m
    C = local_TPC.shape[-1]
    index = _stitch_index(rows, cols, g, m, local_TPC.device)
    stitched = local_TPC.reshape(-1, C).index_select(0, index)
    stitched = stitched.view(win * rows + 2 * m, win * cols + 2 * m, C)
    pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g))  # [C, g, g]
    return pooled.permute(1, 2, 0).reshape(g * g, C)


def vision_projection(z_PC: Tensor, w: VisionWeights) -> Tensor:
    """Projection MLP: [n_patches, 2 * enc_dim] -> [n_patches, proj_out_dim]."""
    return linear(linear_gelu(z_PC, w.proj_fc1.weight, w.proj_fc1.bias), w.proj_fc2)


def check_crops(pixels_NCHW: Tensor, tiling: tuple[int, int], cfg: VisionConfig) -> None:
    rows, cols = tiling
    want = (1 + rows * cols, cfg.in_channels, cfg.crop_size, cfg.crop_size)
    if rows < 1 or cols < 1 or tuple(pixels_NCHW.shape) != want:
        raise VisionInputError(
            f"crops of shape {list(pixels_NCHW.shape)} do not match tiling {tuple(tiling)}: "
            f"expected {list(want)} (1 global crop + rows*cols local crops)"
        )


def encode_image_with_intermediates(
    pixels_NCHW: Tensor, tiling: tuple[int, int], w: VisionWeights, cfg: VisionConfig
) -> VisionOutputs:
    """Like encode_image, also returning encoder features and the projection input."""
    check_crops(pixels_NCHW, tiling, cfg)
    pixels_NCHW = pixels_NCHW.to(device=w.pos_emb.device, dtype=w.pos_emb.dtype)
    features = vision_encoder(pixels_NCHW, w, cfg)
    local = pooled_local_features(features[1:], tiling, cfg)
    proj_input = torch.cat([features[0], local], dim=-1)  # global first, then pooled local
    return VisionOutputs(features, proj_input, vision_projection(proj_input, w))


def encode_image(
    pixels_NCHW: Tensor, tiling: tuple[int, int], w: VisionWeights, cfg: VisionConfig
) -> Tensor:
    """Normalized crops + tiling -> image embeddings [n_patches, proj_out_dim]."""
    return encode_image_with_intermediates(pixels_NCHW, tiling, w, cfg).img_emb

"""Moondream's vision tower, from an image's pixels to its image embeddings.

1. Overlapping crops (host): one global crop (the whole image squashed to crop x crop) plus up
   to ``max_crops`` local crops cut from an upscaled copy. Each local crop keeps a margin of
   ``overlap_margin`` patches on every side that overlaps its neighbours; only its centre window
   of ``grid_side - 2 * overlap_margin`` patches is new. Resampling is libvips lanczos3 through
   ``pyvips.Image.resize(hscale, vscale=...)`` on the uint8 array, the call the reference makes,
   so the crops are byte-identical to the reference's (the fixture's PNG crops check this).
   Pixel normalization reproduces the reference's bfloat16 arithmetic whatever the model dtype.
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

import math
from dataclasses import dataclass

import numpy as np
import pyvips
import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import VisionConfig
from kestrel.moondream.model import VisionBlock, VisionWeights
from kestrel.moondream.text import layer_norm, linear

__all__ = [
    "CropError",
    "OverlapCrops",
    "VisionOutputs",
    "encode_image",
    "encode_image_with_intermediates",
    "normalize_pixels",
    "overlap_crops",
    "patchify",
    "pooled_local_features",
    "select_tiling",
    "vision_encoder",
    "vision_projection",
]


# ---------------------------------------------------------------------- crops (host side)
class CropError(ValueError):
    """Pixels the crop pipeline cannot take (wrong type, bands or dtype)."""


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image area of ``height`` x ``width`` pixels.

    ``crop_size`` is the crop's window (its non-overlapping centre), and height/width are the
    image size minus both margins, as the reference calls it. Reproduces the reference rule
    exactly, including its float arithmetic: small sides give (1, 1); otherwise tiles follow the
    aspect ratio, at least ceil(side / window) per side, at most ``max_crops`` in total.
    """
    if max_crops < 1:
        raise ValueError(f"max_crops must be >= 1, got {max_crops}")
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h = math.ceil(height / crop_size)
    min_w = math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        # Even the minimum does not fit: shrink both sides by the same factor.
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if rows * cols > max_crops:  # trim the longer side back under the budget
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return (max(1, rows), max(1, cols))


@dataclass(frozen=True, slots=True, eq=False)
class OverlapCrops:
    """``crops`` uint8 [N, crop, crop, 3] (read-only): index 0 the global crop, then the local
    crops row-major (index 1 + i * cols + j); ``tiling`` = (rows, cols), N = 1 + rows * cols."""

    crops: np.ndarray
    tiling: tuple[int, int]

    @property
    def n_crops(self) -> int:
        return self.crops.shape[0]


def _as_vips(image: np.ndarray | pyvips.Image) -> pyvips.Image:
    if isinstance(image, pyvips.Image):
        if image.format != "uchar" or image.bands != 3:
            raise CropError(
                f"overlap_crops needs a 3-band uchar image, got {image.bands} band(s) of "
                f"{image.format!r}; pass it through load_image first"
            )
        return image
    if not isinstance(image, np.ndarray):
        raise CropError(f"overlap_crops takes a numpy array or pyvips image, not {type(image)}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
        raise CropError(
            f"overlap_crops needs a non-empty H x W x 3 uint8 array, got {image.dtype} "
            f"{image.shape}; pass it through load_image first"
        )
    return pyvips.Image.new_from_array(np.ascontiguousarray(image))


def _resize(image: pyvips.Image, height: int, width: int) -> np.ndarray:
    # Independent horizontal/vertical scales (aspect not preserved), libvips' default lanczos3.
    resized = image.resize(width / image.width, vscale=height / image.height)
    return np.asarray(resized.numpy(), dtype=np.uint8).reshape(resized.height, resized.width, -1)


def _paste(dst: np.ndarray, src: np.ndarray) -> None:
    # libvips hits the requested size for every geometry we tried; should it ever round one
    # down, the reference leaves the missing edge zero, and so does this.
    dst[: src.shape[0], : src.shape[1]] = src[: dst.shape[0], : dst.shape[1]]


def overlap_crops(
    image: np.ndarray | pyvips.Image, config: VisionConfig, *, max_crops: int | None = None
) -> OverlapCrops:
    """The global crop and the overlapping local crops of an H x W x 3 uint8 RGB image.

    ``max_crops`` overrides ``config.max_crops`` (tests and experiments only).
    """
    vips = _as_vips(image)
    crop = config.crop_size
    margin_px = config.overlap_margin * config.enc_patch_size
    window = (config.grid_side - 2 * config.overlap_margin) * config.enc_patch_size
    rows, cols = select_tiling(
        vips.height - 2 * margin_px,
        vips.width - 2 * margin_px,
        window,
        config.max_crops if max_crops is None else max_crops,
    )
    crops = np.zeros((1 + rows * cols, crop, crop, 3), dtype=np.uint8)
    _paste(crops[0], _resize(vips, crop, crop))
    resized = _resize(vips, rows * window + 2 * margin_px, cols * window + 2 * margin_px)
    for i in range(rows):
        for j in range(cols):
            y0, x0 = i * window, j * window
            _paste(crops[1 + i * cols + j], resized[y0 : y0 + crop, x0 : x0 + crop])
    crops.flags.writeable = False
    return OverlapCrops(crops=crops, tiling=(rows, cols))


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
        raise CropError(
            f"expected uint8 crops [N, H, W, 3], got {crops.dtype} {tuple(crops.shape)}"
        )
    x_NHWC = crops.to(device=device)
    x_NCHW = x_NHWC.permute(0, 3, 1, 2)
    x_NCHW = x_NCHW.to(torch.bfloat16).div(255.0).sub(0.5).div(0.5)
    return x_NCHW.to(dtype).contiguous()


# ---------------------------------------------------------------------- the encoder
class VisionInputError(ValueError):
    """Crops whose count or shape does not match the tiling / config."""


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
    for blk in w.blocks:
        x = x + _attention(layer_norm(x, blk.ln1), blk, cfg.enc_n_heads)
        x = x + linear(F.gelu(linear(layer_norm(x, blk.ln2), blk.fc1), approximate="tanh"), blk.fc2)
    return layer_norm(x, w.post_ln)


def _keep_range(i: int, n: int, g: int, m: int) -> tuple[int, int]:
    """Rows (or cols) of tile i of n kept when stitching: margins drop on interior edges."""
    return (0 if i == 0 else m), (g if i == n - 1 else g - m)


def pooled_local_features(local_TPC: Tensor, tiling: tuple[int, int], cfg: VisionConfig) -> Tensor:
    """Stitch the local tiles' features and pool them to the patch grid: -> [n_patches, C].

    Output grid before pooling: (window * rows + 2m) x (window * cols + 2m) patches with
    window = grid_side - 2m; every output cell comes from exactly one tile.
    """
    rows, cols = tiling
    g, m = cfg.grid_side, cfg.overlap_margin
    win = g - 2 * m
    C = local_TPC.shape[-1]
    tiles = local_TPC.view(rows, cols, g, g, C)
    stitched = local_TPC.new_empty(win * rows + 2 * m, win * cols + 2 * m, C)
    for i in range(rows):
        ys, ye = _keep_range(i, rows, g, m)
        for j in range(cols):
            xs, xe = _keep_range(j, cols, g, m)
            stitched[win * i + ys : win * i + ye, win * j + xs : win * j + xe] = tiles[
                i, j, ys:ye, xs:xe
            ]
    pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g))  # [C, g, g]
    return pooled.permute(1, 2, 0).reshape(g * g, C)


def vision_projection(z_PC: Tensor, w: VisionWeights) -> Tensor:
    """Projection MLP: [n_patches, 2 * enc_dim] -> [n_patches, proj_out_dim]."""
    return linear(F.gelu(linear(z_PC, w.proj_fc1), approximate="tanh"), w.proj_fc2)


def _check_crops(pixels_NCHW: Tensor, tiling: tuple[int, int], cfg: VisionConfig) -> None:
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
    _check_crops(pixels_NCHW, tiling, cfg)
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

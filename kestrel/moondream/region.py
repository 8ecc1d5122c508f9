"""Region module: coordinates and sizes in and out of the text decoder.

- encode_coordinate / encode_size: Fourier features (cos first, then sin, of 2*pi * v @ W) computed
  in the PARAMETER dtype (the value is cast first, as the reference does; float32 features in a
  bf16 model change the outputs), then a linear layer to the text width.
- decode_coordinate / decode_size: tanh-GELU MLPs (Moondream 2) or single Linears (Moondream 3,
  no LayerNorm) over the decoder output BEFORE post_ln, giving logits over coordinate bins and
  over (width, height) size bins.

Bins <-> values (design.md 5.1), all counts read from the config:
- a decoded coordinate bin b is fed back (and reported) as b / coord_bins, as the reference;
- a size bin b means 2 ** (b / (size_bins - 1) * 10 - 10) (log2 scale over [2^-10, 1]);
- a user-given coordinate c keys as round(c * (coord_bins - 1)) (the training-label rule), a size
  s as the inverse of the log scale; both clamped to the bin range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel.moondream.config import RegionConfig
from kestrel.moondream.model import MoondreamModel, RegionWeights
from kestrel.moondream.text import embed_text, layer_norm, linear
from kestrel.tokens import CoordToken, SizeToken, TextToken
from kestrel_kernels.transfer import upload

__all__ = [
    "SpatialRefError",
    "coord_bin_to_value",
    "coord_to_bin",
    "coord_token",
    "decode_coordinate",
    "decode_size",
    "embed_tokens",
    "encode_coordinate",
    "encode_size",
    "size_bin_to_value",
    "size_to_bin",
    "size_token",
    "spatial_ref_tokens",
]

# Sizes live on a log2 scale from 2**_SIZE_LOG2_MIN (one 1024th of the image side) to 1.
_SIZE_LOG2_MIN = -10.0


class SpatialRefError(ValueError):
    """A spatial reference that is neither a point (x, y) nor a box (x0, y0, x1, y1) in [0, 1]."""


def _fourier(v: Tensor, w: Tensor) -> Tensor:
    f = (2 * math.pi * v) @ w  # same association as the reference: scale, then project
    return torch.cat([f.cos(), f.sin()], dim=-1)


def encode_coordinate(c: Tensor, w: RegionWeights) -> Tensor:
    """Coordinates [...] (values in [0, 1]) -> embeddings [..., dim]."""
    c = c.to(device=w.coord_features.device, dtype=w.coord_features.dtype).unsqueeze(-1)
    return linear(_fourier(c, w.coord_features), w.coord_encoder)


def encode_size(wh: Tensor, w: RegionWeights) -> Tensor:
    """Sizes [..., 2] (width, height as image fractions) -> embeddings [..., dim]."""
    wh = wh.to(device=w.size_features.device, dtype=w.size_features.dtype)
    return linear(_fourier(wh, w.size_features), w.size_encoder)


def _region_ln(hidden: Tensor, w: RegionWeights) -> Tensor:
    """The LayerNorm a Moondream 3 file with ``region_model.ln`` puts before both decoders (the
    runtime those files were published for applies it); without it the decoders read the hidden
    state as is, as the first-party reference does."""
    return hidden if w.ln is None else layer_norm(hidden, w.ln)


def decode_coordinate(hidden: Tensor, w: RegionWeights) -> Tensor:
    """Decoder output (pre post_ln) [..., dim] -> coordinate logits [..., coord_bins]."""
    if w.coord_decoder is not None:
        return linear(_region_ln(hidden, w), w.coord_decoder)
    assert w.coord_fc1 is not None and w.coord_fc2 is not None
    return linear(F.gelu(linear(hidden, w.coord_fc1), approximate="tanh"), w.coord_fc2)


def decode_size(hidden: Tensor, w: RegionWeights) -> Tensor:
    """Decoder output [..., dim] -> size logits [..., 2, size_bins] (row 0 width, row 1 height)."""
    if w.size_decoder is not None:
        out = linear(_region_ln(hidden, w), w.size_decoder)
    else:
        assert w.size_fc1 is not None and w.size_fc2 is not None
        out = linear(F.gelu(linear(hidden, w.size_fc1), approximate="tanh"), w.size_fc2)
    return out.view(*out.shape[:-1], 2, -1)


def coord_bin_to_value(b: int, cfg: RegionConfig) -> float:
    """The coordinate a decoded bin stands for: b / coord_bins (reference convention)."""
    return b / cfg.coord_bins


def size_bin_to_value(b: int, cfg: RegionConfig) -> float:
    """2 ** (b / (size_bins - 1) * 10 - 10), computed in float32 exactly like the reference."""
    t = torch.tensor(float(b), dtype=torch.float32)
    span = -_SIZE_LOG2_MIN
    return float(torch.pow(2.0, t / (cfg.size_bins - 1) * span - span))


def coord_to_bin(c: float, cfg: RegionConfig) -> int:
    """Bin of a coordinate value: clamp(round(c * (coord_bins - 1)))."""
    return min(max(round(c * (cfg.coord_bins - 1)), 0), cfg.coord_bins - 1)


def size_to_bin(s: float, cfg: RegionConfig) -> int:
    """Bin of a size value: inverse of the log2 scale, clamped to [0, size_bins - 1]."""
    log2 = math.log2(max(s, 2.0**_SIZE_LOG2_MIN))
    b = round((log2 - _SIZE_LOG2_MIN) / -_SIZE_LOG2_MIN * (cfg.size_bins - 1))
    return min(max(b, 0), cfg.size_bins - 1)


def coord_token(b: int, cfg: RegionConfig) -> CoordToken:
    """The token fed back after the model decoded coordinate bin ``b``."""
    return CoordToken(pos=coord_bin_to_value(b, cfg), bin=b)


def size_token(w_bin: int, h_bin: int, cfg: RegionConfig) -> SizeToken:
    """The token fed back after the model decoded size bins (w_bin, h_bin)."""
    return SizeToken(
        width=size_bin_to_value(w_bin, cfg),
        height=size_bin_to_value(h_bin, cfg),
        width_bin=w_bin,
        height_bin=h_bin,
    )


def _check_unit(ref: Sequence[float]) -> list[float]:
    try:
        vals = [float(v) for v in ref]
    except (TypeError, ValueError) as exc:
        raise SpatialRefError(f"spatial reference {ref!r} must hold numbers") from exc
    if len(vals) not in (2, 4):
        raise SpatialRefError(
            f"spatial reference {ref!r} must be a point (x, y) or a box (x0, y0, x1, y1)"
        )
    if not all(0.0 <= v <= 1.0 for v in vals):
        raise SpatialRefError(f"spatial reference {ref!r} must use coordinates in [0, 1]")
    if len(vals) == 4 and (vals[2] < vals[0] or vals[3] < vals[1]):
        raise SpatialRefError(f"box {ref!r} must have x1 >= x0 and y1 >= y0")
    return vals


def spatial_ref_tokens(
    refs: Sequence[Sequence[float]], cfg: RegionConfig
) -> list[CoordToken | SizeToken]:
    """Prompt tokens of spatial references, in order: a point (x, y) -> two CoordTokens; a box
    (x0, y0, x1, y1) -> CoordToken(cx), CoordToken(cy), SizeToken(x1 - x0, y1 - y0).

    The float is what gets embedded (exactly as the reference embeds it); the bins, from
    coord_to_bin / size_to_bin, are the cache keys.
    """
    out: list[CoordToken | SizeToken] = []
    for ref in refs:
        v = _check_unit(ref)
        if len(v) == 2:
            out += [
                CoordToken(v[0], coord_to_bin(v[0], cfg)),
                CoordToken(v[1], coord_to_bin(v[1], cfg)),
            ]
            continue
        cx, cy, sw, sh = (v[0] + v[2]) / 2, (v[1] + v[3]) / 2, v[2] - v[0], v[3] - v[1]
        out += [
            CoordToken(cx, coord_to_bin(cx, cfg)),
            CoordToken(cy, coord_to_bin(cy, cfg)),
            SizeToken(sw, sh, size_to_bin(sw, cfg), size_to_bin(sh, cfg)),
        ]
    return out


def embed_tokens(
    tokens: Sequence[TextToken | CoordToken | SizeToken], model: MoondreamModel
) -> Tensor:
    """Input embeddings [T, dim] of prompt / feedback tokens: text via wte, coordinates via
    encode_coordinate(pos), sizes via encode_size((width, height)). One batched call per kind.
    """
    dev, dt = model.device, model.dtype
    text_idx, text_ids, coord_idx, coords, size_idx, sizes = [], [], [], [], [], []
    for i, t in enumerate(tokens):
        if isinstance(t, TextToken):
            text_idx.append(i)
            text_ids.append(t.token_id)
        elif isinstance(t, CoordToken):
            coord_idx.append(i)
            coords.append(t.pos)
        elif isinstance(t, SizeToken):
            size_idx.append(i)
            sizes.append((t.width, t.height))
        else:
            raise TypeError(f"cannot embed {type(t).__name__}: only text, coord and size tokens")
    if len(text_idx) == len(tokens):  # the common case: plain text, one lookup
        return embed_text(upload(text_ids, torch.int64, dev), model.text)
    out = torch.empty(len(tokens), model.config.text.dim, device=dev, dtype=dt)
    if text_idx:
        out[text_idx] = embed_text(upload(text_ids, torch.int64, dev), model.text)
    if coord_idx:
        out[coord_idx] = encode_coordinate(upload(coords, dt, dev), model.region)
    if size_idx:
        out[size_idx] = encode_size(upload(sizes, dt, dev), model.region)
    return out

"""Partial rotary position embedding of the Moondream 2 text decoder.

Only the first ``rotary_dim`` dims of each head rotate; the rest pass through. Pairs are
half-split (x[i] with x[i + rotary_dim // 2], GPT-NeoX style), angles p * theta^(-2i/rotary_dim)
in float32, rotation in float32, result cast back to the input dtype.

Layout note: the reference writes the rotated dims back interleaved (a'0, b'0, a'1, b'1, ...);
we keep them half-split (a'0..a'15, b'0..b'15). q and k get the same permutation, so every q.k
score is identical; only raw KV exchanged with the reference would differ.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["apply_rope", "rope_cos_sin"]


@functools.lru_cache(maxsize=16)
def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> Tensor:
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32)[: rotary_dim // 2] / rotary_dim
    return (1.0 / (theta**exponent)).to(device)  # [rotary_dim // 2]


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles, float32, shape ``positions.shape + (rotary_dim//2,)``."""
    inv = _inv_freq(rotary_dim, float(theta), positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x_BTHD: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
    """Rotate the first ``2 * R`` dims of every head of ``x`` [B, T, H, D]; R = cos.shape[-1].

    cos/sin are [B, T, R] float32 (broadcast over heads). Returns a new tensor, same dtype.
    """
    half = cos_BTR.shape[-1]
    rot = 2 * half
    cos = cos_BTR.unsqueeze(2)  # [B, T, 1, R]
    sin = sin_BTR.unsqueeze(2)
    a = x_BTHD[..., :half].float()
    b = x_BTHD[..., half:rot].float()
    a_out = a * cos - b * sin
    b_out = a * sin + b * cos
    rotated = torch.cat([a_out, b_out], dim=-1).to(x_BTHD.dtype)
    return torch.cat([rotated, x_BTHD[..., rot:]], dim=-1)

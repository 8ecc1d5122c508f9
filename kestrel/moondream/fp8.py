"""FP8 expert weights: the row-scaled float8_e4m3 form Moondream 3 is published in.

A quantised expert matrix ``q`` [E, N, K] (float8_e4m3fn) comes with a float32 ``scale`` [E, N],
one per OUTPUT row, taken over the input dimension K:

    w[e, n, :] ~= q[e, n, :].float() * scale[e, n]

:func:`quantize_rows` writes that form (absmax / 448 per row: the largest magnitude of a row maps
to e4m3's largest finite value), :func:`dequantize_rows` reads it back. Two ways to multiply by
such a matrix (:func:`expert_linear`):

- dequantise on use: the rows of the experts a token routes to are widened to the activations'
  dtype just before their matmul and dropped after it; the stack itself stays FP8;
- a row-scaled FP8 GEMM (``torch._scaled_mm`` with per-row scales of both operands): the
  activations are quantised per row too, and the product is rescaled by both scale vectors.
  This is the Hopper path; torch also runs it on CPU, which is how the tests check it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "as_fp8",
    "dequantize_rows",
    "expert_linear",
    "fp8_gemm_supported",
    "is_fp8",
    "quantize_rows",
    "scaled_linear",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


def is_fp8(t: Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def as_fp8(t: Tensor) -> Tensor:
    """``t`` as float8_e4m3fn: as is, or a uint8 view of the same bytes reinterpreted (the form
    a ``.pt`` file may hold them in). Anything else is a ``TypeError``."""
    if t.dtype == FP8_DTYPE:
        return t
    if t.dtype == torch.uint8:
        return t.view(FP8_DTYPE)
    raise TypeError(f"expected float8_e4m3fn (or its uint8 bytes), got {t.dtype}")


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` [..., N, K] -> (q float8_e4m3fn [..., N, K], scale float32 [..., N]), absmax / 448
    per row. An all-zero row gets scale 1 (its q is zero)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q.float() * scale[..., None]`` cast to ``dtype``: the weights the file stands for."""
    return (q.float() * scale.float()[..., None]).to(dtype)


@functools.lru_cache(maxsize=16)
def _cuda_fp8_gemm(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def fp8_gemm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the row-scaled FP8 GEMM is the expert path: a Hopper-class (SM 9.0+) CUDA
    device with bfloat16 activations. Elsewhere experts are dequantised on use."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return _cuda_fp8_gemm(device.index if device.index is not None else 0)


def _quantize_activations(x_MK: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row absmax scaling of the activations, on the device (no host synchronisation)."""
    amax = x_MK.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [M, 1]
    return (x_MK.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_linear(x_MK: Tensor, q_NK: Tensor, scale_N: Tensor) -> Tensor:
    """x @ (q * scale)^T [M, N] through ``torch._scaled_mm`` with row-wise scales: the
    activations are quantised per row, the weight's row scales are the file's."""
    xq, x_scale = _quantize_activations(x_MK)
    out = torch._scaled_mm(
        xq,
        q_NK.t(),  # column-major [K, N], as the kernel wants its second operand
        scale_a=x_scale,
        scale_b=scale_N.float()[None, :],
        out_dtype=x_MK.dtype,
    )
    return out


def expert_linear(x_MK: Tensor, q_NK: Tensor, scale_N: Tensor, *, scaled_mm: bool) -> Tensor:
    """x @ w^T for one FP8 expert matrix: the row-scaled FP8 GEMM, or the expert's rows
    dequantised into a temporary of this one matrix (freed when the call returns)."""
    if scaled_mm:
        return scaled_linear(x_MK, q_NK, scale_N)
    return torch.nn.functional.linear(x_MK, dequantize_rows(q_NK, scale_N, x_MK.dtype))

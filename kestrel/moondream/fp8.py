"""FP8 expert weights: the row-scaled float8_e4m3 form Moondream 3 is published in.

A quantised expert matrix ``q`` [E, N, K] (float8_e4m3fn) comes with a float32 ``scale`` [E, N],
one per OUTPUT row, taken over the input dimension K:

    w[e, n, :] ~= q[e, n, :].float() * scale[e, n]

:func:`quantize_rows` writes that form (absmax / 448 per row: the largest magnitude of a row maps
to e4m3's largest finite value), :func:`dequantize_rows` reads it back; both live with the
kernels that quantise activations the same way (``kestrel_kernels.moe``) and are re-exported
here. The MoE multiplies by such stacks through ``kestrel_kernels.moe.grouped_linear``: the
row-scaled FP8 grouped GEMM on a Hopper GPU (the activations quantised per row too), the
experts widened on use elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kestrel_kernels.moe import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "as_fp8",
    "dequantize_rows",
    "is_fp8",
    "quantize_rows",
]


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

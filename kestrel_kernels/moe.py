"""Moondream 3's expert work and tau factors as a few launches with static shapes, no host sync.

A mixture-of-experts layer over N tokens, each routed to k of E experts, runs as:

    plan = plan_experts(experts_Nk, expert_ids_E)   # sort the N*k (token, slot) pairs by expert
    rows = gather_rows(x_NC, plan, quantize=...)     # each pair's token row, in that order
    hg = grouped_linear(rows, up_ENK, plan.offs, up_scale_EN)    # one grouped GEMM
    act = geglu(hg, quantize=...)                    # GELU(h) * (g + 1)
    y = grouped_linear(act, down_ENK, plan.offs, down_scale_EN)  # one grouped GEMM
    out_NC = combine(y, plan, rows, weights_Nk)      # each token's k rows, routing-weighted

Every shape is a function of N, k and the widths (M = N * k rows, exactly the pairs: no padding,
no capacity to overflow), and the expert offsets are computed on the device
(``torch.searchsorted`` over the sorted expert ids), so the same code runs in prefill, in
decode and inside a CUDA graph. The grouped GEMMs are PyTorch's ``torch._grouped_mm`` (bf16 /
fp16 / fp32, rows and the transposed expert stack 16-byte aligned) and, for FP8 experts (a
float8_e4m3 stack with one float32 scale per output row), ``torch._scaled_grouped_mm`` with the
activations quantised per row, where it runs (``scaled_grouped_supported``: a Hopper-class GPU,
bf16 activations). Elsewhere FP8 experts are widened on use: on CUDA the stack in one cast (no
host sync, graph-safe), on a CPU only the experts that have rows, one at a time (there the host
is the device: reading the offsets costs nothing). Shapes the grouped GEMM refuses (float64,
unaligned widths) take the same per-expert loop.

The gather, the activation, the combine and the tau factors each have a torch form (what a CPU
runs, and the numerics reference) and a Triton form (``triton_moe.py``: one launch each; the
gather and the activation also quantise their rows for the FP8 GEMM, and the gather writes the
inverse permutation the combine reads, so un-sorting costs nothing extra). The Triton forms
run where ``fused.fused_backend`` says (CUDA, or a CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_kernels.counting import opaque
from kestrel_kernels.fused import fused_backend

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "ExpertPlan",
    "Rows",
    "combine",
    "dequantize_rows",
    "gather_rows",
    "geglu",
    "grouped_linear",
    "plan_experts",
    "quantize_rows",
    "scaled_grouped_reference",
    "scaled_grouped_supported",
    "tau_scales",
    "widens_per_expert",
]

FP8_DTYPE = torch.float8_e4m3fn  # the published experts
FP8_MAX = 448.0  # e4m3fn's largest finite value


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """The (token, slot) pairs sorted by expert: ``order`` int64 [M] (sorted row i is flat pair
    ``order[i]`` = token * k + slot), ``offs`` int32 [E] (the end of each expert's rows)."""

    order: Tensor
    offs: Tensor
    k: int


@dataclass(frozen=True, slots=True)
class Rows:
    """Activations in expert order: ``x`` [M, K] (float8_e4m3 when quantised), ``scale``
    float32 [M] (quantised only), ``inv`` int64 [M] (flat pair -> sorted row; gather's Triton
    form only, else None)."""

    x: Tensor
    scale: Tensor | None = None
    inv: Tensor | None = None


def plan_experts(experts_Nk: Tensor, expert_ids_E: Tensor) -> ExpertPlan:
    """Sort the pairs by expert (stable: token order within an expert) and find each expert's
    end offset on the device. ``expert_ids_E``: ``arange(E)`` in the experts' dtype and device
    (kept by the weights, so no launch makes it)."""
    sorted_e, order = torch.sort(experts_Nk.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_e, expert_ids_E, right=True, out_int32=True)
    return ExpertPlan(order, offs, experts_Nk.shape[1])


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` [..., N, K] -> (q float8_e4m3fn [..., N, K], scale float32 [..., N]), absmax / 448
    per row; an all-zero row gets scale 1. The experts' published form, and the activations'
    for the FP8 grouped GEMM (torch form; the gather and GeGLU kernels fuse it)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q.float() * scale[..., None]`` cast to ``dtype``: the weights the file stands for."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def _triton(t: Tensor) -> bool:
    return fused_backend(t.device) == "triton"


def gather_rows(x_NC: Tensor, plan: ExpertPlan, *, quantize: bool) -> Rows:
    """Row i = x[order[i] // k] (quantised per row for the FP8 GEMM when ``quantize``)."""
    if _triton(x_NC) and x_NC.is_contiguous():
        from kestrel_kernels.triton_moe import gather_triton

        with opaque("moe_gather"):
            return Rows(*gather_triton(x_NC, plan.order, plan.k, quantize))
    x_MC = x_NC.index_select(0, torch.div(plan.order, plan.k, rounding_mode="floor"))
    return Rows(*quantize_rows(x_MC)) if quantize else Rows(x_MC)


def geglu(hg_MI: Tensor, *, quantize: bool) -> Rows:
    """GELU_exact(h) * (g + 1) of ``hg = [h; g]`` (quantised per row when ``quantize``)."""
    if _triton(hg_MI) and hg_MI.is_contiguous():
        from kestrel_kernels.triton_moe import geglu_triton

        with opaque("moe_geglu"):
            return Rows(*geglu_triton(hg_MI, quantize))
    h, g = hg_MI.chunk(2, dim=-1)
    act = F.gelu(h) * (g + 1)
    return Rows(*quantize_rows(act)) if quantize else Rows(act)


def combine(y_MC: Tensor, plan: ExpertPlan, rows: Rows, weights_Nk: Tensor) -> Tensor:
    """out[n] = sum_j w[n, j] y[row of pair (n, j)], the weights rounded to ``y``'s dtype
    first (as the reference casts them), summed in slot order. [N, C]."""
    N, k = weights_Nk.shape
    if rows.inv is not None and _triton(y_MC):
        from kestrel_kernels.triton_moe import combine_triton

        with opaque("moe_combine"):
            return combine_triton(y_MC, rows.inv, weights_Nk)
    y_pairs = torch.empty_like(y_MC).index_copy_(0, plan.order, y_MC)  # back to token-major
    w_N1k = weights_Nk.to(y_MC.dtype)[:, None, :]
    return torch.bmm(w_N1k, y_pairs.view(N, k, -1))[:, 0]


@functools.lru_cache(maxsize=16)
def _cuda_scaled_grouped(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def scaled_grouped_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FP8 experts go through ``torch._scaled_grouped_mm``: a Hopper-class (SM 9.0+)
    CUDA device and bf16 activations."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return _cuda_scaled_grouped(device.index if device.index is not None else 0)


def _aligned(x_MK: Tensor, w_ENK: Tensor) -> bool:
    """What ``torch._grouped_mm`` takes: fp32 / fp16 / bf16, 16-byte aligned strides."""
    if x_MK.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    size = x_MK.element_size()
    return (x_MK.shape[1] * size) % 16 == 0 and (w_ENK.shape[1] * size) % 16 == 0


def grouped_linear(rows: Rows, w_ENK: Tensor, offs_E: Tensor, scale_EN: Tensor | None) -> Tensor:
    """Row block e (``offs``) times expert e's matrix transposed: [M, N], in the activations'
    dtype (bf16 when the rows are quantised). ``w_ENK``: the [E, N, K] stack (``Linear``
    layout), float8_e4m3 with ``scale_EN`` float32 [E, N], or plain with None. Under
    ``torch.compile`` other activations than bf16 take a per-row gather (``_gathered``)."""
    x = rows.x
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return _gathered(x, w_ENK, offs_E, scale_EN)  # the grouped GEMM traces in bf16 only
    if rows.scale is not None:  # quantised rows: the row-scaled FP8 grouped GEMM
        assert scale_EN is not None
        return _scaled_grouped(x, rows.scale, w_ENK, scale_EN, offs_E)
    if scale_EN is None and _aligned(x, w_ENK):
        return torch._grouped_mm(x, w_ENK.transpose(1, 2), offs=offs_E)
    if scale_EN is not None and not widens_per_expert(x):  # one cast: static, no host sync
        wide = dequantize_rows(w_ENK, scale_EN, x.dtype)
        if _aligned(x, wide):
            return torch._grouped_mm(x, wide.transpose(1, 2), offs=offs_E)
        w_ENK, scale_EN = wide, None
    return _each_expert(x, w_ENK, offs_E, scale_EN)


def _gathered(x_MK: Tensor, w_ENK: Tensor, offs_E: Tensor, scale_EN: Tensor | None) -> Tensor:
    """Each row times its own expert's matrix, gathered per row: static and sync-free like the
    grouped GEMM, but a copy of M matrices. What ``torch.compile`` traces for activations the
    grouped GEMM's tracing refuses (it takes bf16 only); nothing else runs it."""
    rows = torch.arange(x_MK.shape[0], device=x_MK.device, dtype=offs_E.dtype)
    expert = torch.searchsorted(offs_E, rows, right=True)  # [M]
    w = w_ENK.index_select(0, expert)  # [M, N, K]
    if scale_EN is not None:
        w = dequantize_rows(w, scale_EN.index_select(0, expert), x_MK.dtype)
    return torch.bmm(w, x_MK[:, :, None])[:, :, 0]


def widens_per_expert(x: Tensor) -> bool:
    """Whether FP8 experts (off the scaled GEMM) are widened one routed expert at a time, the
    offsets read on the host: on a CPU, where the host is the device and a whole stack widened
    per call would cost far more; on a GPU the stack is widened in one cast (graph-safe)."""
    return x.device.type == "cpu"


def _each_expert(x_MK: Tensor, w_ENK: Tensor, offs_E: Tensor, scale_EN: Tensor | None) -> Tensor:
    """The grouped GEMM one expert at a time, offsets read on the host (a CPU, or shapes the
    grouped GEMM refuses); an FP8 expert's rows are widened only when it has rows."""
    out = x_MK.new_empty(x_MK.shape[0], w_ENK.shape[1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            w = w_ENK[e]
            if scale_EN is not None:
                w = dequantize_rows(w, scale_EN[e], x_MK.dtype)
            out[start:end] = F.linear(x_MK[start:end], w)
        start = end
    return out


def _scaled_grouped(xq: Tensor, x_scale: Tensor, q_ENK: Tensor, scale_EN: Tensor, offs_E: Tensor):
    if xq.is_cuda:
        return torch._scaled_grouped_mm(
            xq, q_ENK.transpose(1, 2), x_scale, scale_EN.float(), offs=offs_E,
            out_dtype=torch.bfloat16,
        )  # fmt: skip
    with opaque("scaled_grouped_mm"):  # the counting stand-in for the one Hopper launch
        return scaled_grouped_reference(xq, x_scale, q_ENK, scale_EN, offs_E)


def scaled_grouped_reference(
    xq: Tensor, x_scale: Tensor, q_ENK: Tensor, scale_EN: Tensor, offs_E: Tensor
) -> Tensor:
    """What ``torch._scaled_grouped_mm`` computes, in float32 on any device: (xq * x_scale)
    times each expert's (q * scale) transposed, rounded to bf16 once."""
    x = xq.float() * x_scale.float()[:, None]
    w = dequantize_rows(q_ENK, scale_EN, torch.float32)
    return _each_expert(x, w, offs_E, None).to(torch.bfloat16)


def tau_scales(lin_BT2H: Tensor, positions_BT: Tensor, alpha_H: Tensor) -> tuple[Tensor, Tensor]:
    """Moondream 3's q and v factors [B, T, H] from the tau logits ``[q_lin; v_lin]``:
    tanh(lin) + 1 + sigmoid(alpha * ln(s + 1)) - 0.5 at absolute positions s."""
    H = alpha_H.shape[0]
    if _triton(lin_BT2H) and lin_BT2H.is_contiguous():
        from kestrel_kernels.triton_moe import tau_triton

        with opaque("tau_scales"):
            return tau_triton(lin_BT2H, positions_BT, alpha_H)
    log_pos = (positions_BT.to(lin_BT2H.dtype) + 1).log()  # [B, T]
    tau_pos = 1 + (torch.sigmoid(alpha_H * log_pos[..., None]) - 0.5)
    t = torch.tanh(lin_BT2H)
    return t[..., :H] + tau_pos, t[..., H:] + tau_pos

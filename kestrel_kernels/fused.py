"""Fused ops of the decoder and the vision encoder: one launch where torch takes several.

    q = rope_write_kv(qkv, cos, sin, KvWrite(k_cache, v_cache, slots), HeadLayout(H, Hkv, D))
    x, h = add_layer_norm(x, (attn_out, mlp_out), ln_weight, ln_bias, eps)
    y = linear_gelu(x, weight, bias)

Each has a torch form (the numerics reference, and what runs on a CPU) and a fused form:

- ``rope_write_kv``: partial rotary embedding of the query and key heads of a fused qkv
  projection (Moondream 3's tau factors scale q and v first), the rotated keys and the values
  written to their KV pages (slots < 0 write nothing), the rotated queries returned
  ``[B, T, H, D]``. torch: ~20 ops (the rotation in float32, two casts, a concatenation, the
  sync-free masked page write); fused: one Triton kernel.
- ``add_layer_norm``: the residual stream plus the block's outputs, then the next LayerNorm.
  torch: 2-3 ops; fused: one Triton kernel. The sum is formed in the storage dtype in the
  same order as the torch form (x + a, then + m).
- ``linear_gelu``: ``gelu_tanh(x @ W.T + b)``. torch: two ops; on CUDA one cuBLASLt call with
  a GELU epilogue (``torch._addmm_activation``, whose CUDA GELU is the tanh form). That op is
  not used on a CPU, where its GELU is the exact (erf) one.

``set_fused_backend("auto" | "torch" | "triton")`` (or ``KESTREL_FUSED`` in the environment):
"auto" fuses on CUDA when Triton imports, else runs the torch forms; "triton" forces the fused
forms (on a CPU only under ``TRITON_INTERPRET=1``, which is how tests and
``scripts/count_kernels.py`` run them; there ``linear_gelu`` computes its torch form but counts
as the one launch it is on a GPU). The default is "auto": on an H200 ``pytest -m gpu`` ran
with it (the kernels against their torch forms, the whole model fused against unfused; its one
failure, torch.compile tracing the package probe, is fixed in ``fused_backend``), and a batch-1
decode step ran 224 kernels in 1.67 ms instead of 726 in 2.66 ms (docs/benchmarks.md). Under
``torch.compile`` the torch forms run.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_kernels.contract import (
    BackendUnavailableError,
    EnvSwitch,
)
from kestrel_kernels.counting import opaque
from kestrel_kernels.kv_write import HeadLayout, KvWrite
from kestrel_kernels.torch_backend import write_kv_indexed, write_kv_scaled

__all__ = [
    "HeadLayout",
    "KvWrite",
    "add_layer_norm",
    "fused_backend",
    "get_fused_backend",
    "linear_gelu",
    "rope_write_kv",
    "set_fused_backend",
    "triton_available",
]

_FUSED = EnvSwitch("KESTREL_FUSED", ("auto", "torch", "triton"), "auto", "fused backend")


def set_fused_backend(name: str) -> None:
    """What the fused ops run: "auto" (Triton on CUDA when it imports), "torch" or "triton"."""
    _FUSED.set(name)


def get_fused_backend() -> str:
    return _FUSED.value


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (looked up once per process)."""
    return importlib.util.find_spec("triton") is not None


def fused_backend(device: torch.device) -> str:
    """The form the fused ops take for tensors on ``device``: "triton" or "torch". Under
    ``torch.compile`` always the torch forms: Inductor fuses them itself, and the Triton
    launchers and the package probe are not traceable."""
    mode = _FUSED.value
    if mode == "torch" or torch.compiler.is_compiling():
        return "torch"
    if mode == "triton":
        if not triton_available():
            raise BackendUnavailableError("fused backend 'triton' needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailableError(
                "fused backend 'triton' on a CPU runs only under TRITON_INTERPRET=1"
            )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


# --- rope + kv write --------------------------------------------------------------------------


def _rope_torch(x_BTHD: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
    half = cos_BTR.shape[-1]
    rot = 2 * half
    cos, sin = cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2)
    a = x_BTHD[..., :half].float()
    b = x_BTHD[..., half:rot].float()
    rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x_BTHD.dtype)
    return torch.cat([rotated, x_BTHD[..., rot:]], dim=-1)


def rope_write_kv(
    qkv_BTX: Tensor,
    cos_BTR: Tensor,
    sin_BTR: Tensor,
    kv: KvWrite,
    heads: HeadLayout,
    *,
    tau_q: Tensor | None = None,
    tau_v: Tensor | None = None,
) -> Tensor:
    """Rotate q and k of ``qkv_BTX`` ``[B, T, (H + 2 Hkv) D]`` (``heads``), write k and v to
    the pages ``kv`` names; return q ``[B, T, H, D]`` (contiguous).

    ``cos_BTR`` / ``sin_BTR``: float32 ``[B, T, R]`` (``2R`` dims of a head rotate, half-split);
    ``tau_q`` ``[B, T, H]`` / ``tau_v`` ``[B, T, Hkv]``: Moondream 3's factors, or None.
    ``kv.kv_scales``: the pages are the contract's scaled (FP8) case; its torch form runs.
    """
    B, T, _ = qkv_BTX.shape
    H, G, D = heads.n_heads, heads.n_kv_heads, heads.head_dim
    k_cache, v_cache, slots, kv_scales = kv.k_cache, kv.v_cache, kv.slots, kv.kv_scales
    if kv_scales is None and fused_backend(qkv_BTX.device) == "triton":
        from kestrel_kernels.triton_fused import rope_write_kv_triton

        q = rope_write_kv_triton(
            qkv_BTX.reshape(B * T, -1), cos_BTR.reshape(B * T, -1), sin_BTR.reshape(B * T, -1),
            kv, heads,
            None if tau_q is None else tau_q.reshape(B * T, H),
            None if tau_v is None else tau_v.reshape(B * T, G),
        )  # fmt: skip
        return q.view(B, T, H, D)
    v = qkv_BTX[..., (H + G) * D :]
    if tau_q is not None:
        assert tau_v is not None
        q_BTHD = qkv_BTX[..., : H * D].view(B, T, H, D) * tau_q[..., None]
        k_BTHD = qkv_BTX[..., H * D : (H + G) * D].view(B, T, G, D)
        qk_in = torch.cat([q_BTHD, k_BTHD], dim=2)
        v = (v.view(B, T, G, D) * tau_v[..., None]).reshape(B, T, G * D)
    else:
        qk_in = qkv_BTX[..., : (H + G) * D].view(B, T, H + G, D)
    qk = _rope_torch(qk_in, cos_BTR, sin_BTR)  # q and k rotate in one call
    k_NGD, v_NGD = qk[:, :, H:].reshape(B * T, G, D), v.reshape(B * T, G, D)
    if kv_scales is None:
        write_kv_indexed(k_cache, v_cache, slots, k_NGD, v_NGD)
    else:
        write_kv_scaled(k_cache, v_cache, slots, k_NGD, v_NGD, kv_scales)
    return qk[:, :, :H].contiguous()


# --- residual add + layer norm ----------------------------------------------------------------


def add_layer_norm(
    x: Tensor, deltas: tuple[Tensor, ...], weight: Tensor, bias: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``x + deltas[0] + deltas[1] ...`` (in that order, in ``x``'s dtype) and its LayerNorm.

    Returns ``(x_new, h)``; with no deltas ``x_new`` is ``x``."""
    if fused_backend(x.device) == "triton" and x.is_contiguous():
        from kestrel_kernels.triton_fused import add_layer_norm_triton

        shape = x.shape
        x2, h2 = add_layer_norm_triton(
            x.reshape(-1, shape[-1]), tuple(d.reshape(-1, shape[-1]) for d in deltas),
            weight, bias, eps,
        )  # fmt: skip
        return x2.view(shape), h2.view(shape)
    for d in deltas:
        x = x + d
    return x, F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# --- linear + gelu ----------------------------------------------------------------------------


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``gelu_tanh(x @ weight.T + bias)``: one cuBLASLt launch on CUDA, two ops elsewhere."""
    if fused_backend(x.device) == "triton" and bias is not None:
        if x.is_cuda:
            flat = x.reshape(-1, x.shape[-1])
            out = torch._addmm_activation(bias, flat, weight.t(), use_gelu=True)
            return out.view(*x.shape[:-1], weight.shape[0])
        with opaque("addmm_gelu_epilogue"):  # its CPU form stands in for the one CUDA launch
            return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")

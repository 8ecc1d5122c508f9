"""Every kernel kestrel launches; attention and the KV write behind one contract (``contract``).

The rule for what lives here: every Triton or CUDA kernel, with its launcher, its torch
reference where it has one and its dispatch, whatever it computes; the code that decides what
to compute (the model, the crop wing, the runtime) lives above and calls in. So this package
holds attention and the KV write (this module's face), the fused ops (``fused``,
``triton_fused``), the MoE kernels (``moe``, ``triton_moe``), the flash-decoding kernel
(``triton_decode``) and the image resampler that cuts an image's crops on the GPU in libvips'
integer arithmetic (``triton_resample``, jitted in ``_resample_jit``; its tables and their
layout are the crop wing's, ``kestrel/crops/resample.py`` and ``stages.py``), with the pinned
memory, uploads and launch counting they share. It imports nothing of ``kestrel``.

Attention backends are objects (``backends``): ``TorchBackend`` (``"torch"``, the reference:
page-table gather, explicit mask, SDPA; CPU and GPU) and ``FlashBackend`` (``"fa"``,
FlashAttention 4 from the ``flash-attn-4`` package, the ``gpu`` extra, on a compute capability
9.x GPU; alias ``"fa3"``), each with ``plan`` and ``forward`` and the fixed buffers its CUDA
graphs read (``graph_inputs``); ``TritonDecode(base, route)`` is ``base`` on a measured
decode route. ``resolve_backend(name, device,
dtype)`` turns a name into one, once: ``"auto"`` picks ``"fa"`` for float16/bfloat16 inputs on
such a GPU when the package imports, else ``"torch"``. FlashAttention is imported lazily by
the ``fa`` backend, so importing this package on a CPU machine never touches it.
Decode-shaped calls can instead run a Triton flash-decoding kernel (``triton_decode``): under
the default ``KESTREL_DECODE_KERNEL=auto`` a CUDA runtime measures both at start-up and serves
on a ``TritonDecode`` that keeps the faster per batch size (``decode_tune``);
``set_decode_kernel`` / the variable force ``"fa"`` or ``"triton"`` (``decode_route``).
"""

from __future__ import annotations

from kestrel_kernels.attention import attend, paged_attention, plan_attention, plan_batch, write_kv
from kestrel_kernels.backends import (
    AttentionBackend,
    FlashBackend,
    TorchBackend,
    TritonDecode,
    available_backends,
    get_default_backend,
    prepare_compile,
    resolve_backend,
    set_default_backend,
)
from kestrel_kernels.batch import AttentionBatch
from kestrel_kernels.contract import BackendUnavailableError, KernelInputError, KvScales
from kestrel_kernels.decode_route import get_decode_kernel, set_decode_kernel
from kestrel_kernels.plan import AttentionMeta, AttentionPlan

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionMeta",
    "AttentionPlan",
    "BackendUnavailableError",
    "FlashBackend",
    "KernelInputError",
    "KvScales",
    "TorchBackend",
    "TritonDecode",
    "attend",
    "available_backends",
    "get_decode_kernel",
    "get_default_backend",
    "paged_attention",
    "plan_attention",
    "plan_batch",
    "prepare_compile",
    "resolve_backend",
    "set_decode_kernel",
    "set_default_backend",
    "write_kv",
]

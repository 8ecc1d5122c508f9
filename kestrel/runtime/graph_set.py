"""Which CUDA graphs a runtime keeps, built and captured at start-up.

Decode steps (``cuda_graphs.DecodeGraphs``) are graph-captured with the ``fa`` backend on CUDA
(or compiled, with ``compile=True``); with FP8 KV pages only when decode attention runs the
Triton decode kernel there (``DecodeRoute.serves_fp8``: sync-free over scaled pages; the
torch reference reads lengths on the host). Before the graphs are built,
``choose_decode_kernels`` measures FlashAttention against the Triton decode kernel for every
bucket (``kestrel_kernels.decode_tune``, under ``KESTREL_DECODE_KERNEL=auto``) and gives the
backend the runtime serves on: the resolved one, or a ``TritonDecode`` over it holding the
measured route, so each bucket's graph holds the faster kernel; over FP8 pages it checks the
Triton kernel against the scaled reference, and only a kernel that agrees serves them (and
lets FP8 decode be captured).
The vision encoder (``vision_graphs``) is captured alongside whenever nothing is compiled: it
touches no KV. Prefill (``prefill_graphs``) is captured too, for both families (Moondream 3's
MoE layers are grouped GEMMs with static shapes and no host sync, ``moe.moe_mlp``), unless the
pages are FP8: scaled prefill attention gathers and widens each row's pages up to the longest
row, a length it reads on the host; a graph would have to widen every row's whole page-table
width instead (4,096 positions per row and layer, ~5x a chart question's ~770 keys), so
FP8-page prefill stays eager. ``capture_all`` captures every one of them; the runtime calls it
once, before it serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import Tensor

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV
from kestrel.runtime.cuda_graphs import DecodeGraphs, bucket_sizes, graphs_supported
from kestrel.runtime.prefill_graphs import PrefillGraphs
from kestrel.runtime.vision_graphs import VisionGraphs
from kestrel_kernels.backends import AttentionBackend, TritonDecode
from kestrel_kernels.contract import default_scale
from kestrel_kernels.decode_route import get_decode_kernel
from kestrel_kernels.decode_tune import DecodeTrial, check_fp8, route_of, tune_pool
from kestrel_kernels.fused import triton_available

__all__ = ["GraphSet", "choose_decode_kernels"]

log = logging.getLogger("kestrel.runtime")
_MEASURED: dict[tuple, list[DecodeTrial]] = {}  # choose_decode_kernels' timings, by shapes


@dataclass(frozen=True, slots=True)
class GraphSet:
    decode: DecodeGraphs | None = None
    prefill: PrefillGraphs | None = None
    vision: VisionGraphs | None = None

    @classmethod
    def build(
        cls,
        model: MoondreamModel,
        kv: PagedKV,
        page_table_RP: Tensor,
        *,
        max_batch_size: int,
        backend: AttentionBackend,
        capture: bool,
        compile: bool,
        fp8_kv: bool,
    ) -> GraphSet:
        """The graphs this model and configuration can use (module doc); none captured yet."""
        graphs = graphs_supported(model, backend)
        if not (graphs or compile):
            return cls()
        decode = None
        if not fp8_kv or backend.decode_route.serves_fp8(model.device):
            decode = DecodeGraphs(
                model, kv, page_table_RP, max_batch_size=max_batch_size, backend=backend,
                capture=capture and graphs, compile=compile,
            )  # fmt: skip
        if not (capture and graphs) or compile:
            return cls(decode)
        prefill = None
        if not fp8_kv:
            prefill = PrefillGraphs(
                model, kv, page_table_RP, max_batch_size=max_batch_size, backend=backend
            )
        return cls(decode, prefill, VisionGraphs(model))

    def capture_all(self) -> None:
        for graphs in (self.decode, self.prefill, self.vision):
            if graphs is not None:
                graphs.capture_all()


def choose_decode_kernels(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    *,
    max_batch_size: int,
    backend: AttentionBackend,
    capture: bool,
    compile: bool,
) -> tuple[list[DecodeTrial], AttentionBackend]:
    """Before the graphs are built: which decode kernel each bucket captures (module doc),
    measured over the idle pool's first layer (once per process for the same device and
    shapes); over FP8 pages, whether the Triton kernel agrees with the scaled reference.
    Returns the trials and the backend to serve on (``backend`` on the measured route).
    Nothing is measured when no graph is captured, Triton is missing or the kernel is forced;
    a failed measurement leaves FlashAttention (and the reference over FP8 pages) everywhere.
    """
    if not (capture and graphs_supported(model, backend)) or compile:
        return [], backend
    if get_decode_kernel() != "auto" or not triton_available():
        return [], backend
    cfg = model.config.text
    scale, width = default_scale(cfg.head_dim, None), page_table_RP.shape[1]
    scales = getattr(kv, "kv_scales", None)
    sizes = bucket_sizes(max_batch_size)
    try:
        if scales is not None:
            trials = check_fp8(kv.k[0], kv.v[0], scales[0], (sizes[0], sizes[-1]), width,
                               cfg.n_heads, softmax_scale=scale, q_dtype=model.dtype)  # fmt: skip
            return trials, TritonDecode(backend, route_of(trials, fp8=True))
        # the same shapes on the same device time the same: measured once per process
        key = (str(kv.k[0].device), kv.k[0].dtype, kv.k[0].shape[1:], cfg.n_heads, width, sizes)
        trials = _MEASURED.get(key)
        if trials is None:
            trials = tune_pool(kv.k[0], kv.v[0], sizes, width, cfg.n_heads)
            _MEASURED[key] = trials
    except Exception as exc:  # a kernel that cannot run here is not chosen
        log.warning("decode kernel measurement failed, FlashAttention serves decode: %s", exc)
        return [], backend
    return trials, TritonDecode(backend, route_of(trials))

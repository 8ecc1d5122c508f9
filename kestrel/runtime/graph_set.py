"""Which CUDA graphs a runtime keeps, built and captured at start-up.

Decode steps (``cuda_graphs.DecodeGraphs``) are graph-captured with the ``fa`` backend on CUDA
(or compiled, with ``compile=True``); with FP8 KV pages only when decode attention runs the
Triton decode kernel (``KESTREL_DECODE_KERNEL=triton``: sync-free over scaled pages; the
default runs the torch reference there, which reads lengths on the host). The vision encoder
(``vision_graphs``) is captured alongside whenever nothing is compiled: it touches no KV and no
MoE. Prefill (``prefill_graphs``) is captured too when the model has no MoE layers (Moondream
3's grouped MoE synchronises in prefill) and the pages are not FP8 (scaled prefill attention
reads lengths on the host). ``capture_all`` captures every one of them; the runtime calls it
once, before it serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV
from kestrel.runtime.cuda_graphs import DecodeGraphs, graphs_supported
from kestrel.runtime.prefill_graphs import PrefillGraphs
from kestrel.runtime.vision_graphs import VisionGraphs
from kestrel_kernels.dispatch import get_decode_kernel

__all__ = ["GraphSet"]


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
        backend: str,
        capture: bool,
        compile: bool,
        fp8_kv: bool,
    ) -> GraphSet:
        """The graphs this model and configuration can use (module doc); none captured yet."""
        graphs = graphs_supported(model, backend)
        if not (graphs or compile):
            return cls()
        decode = None
        if not fp8_kv or get_decode_kernel() == "triton":
            decode = DecodeGraphs(
                model, kv, page_table_RP, max_batch_size=max_batch_size, backend=backend,
                capture=capture and graphs, compile=compile,
            )  # fmt: skip
        if not (capture and graphs) or compile:
            return cls(decode)
        prefill = None
        if model.config.text.moe is None and not fp8_kv:
            prefill = PrefillGraphs(
                model, kv, page_table_RP, max_batch_size=max_batch_size, backend=backend
            )
        return cls(decode, prefill, VisionGraphs(model))

    def capture_all(self) -> None:
        for graphs in (self.decode, self.prefill, self.vision):
            if graphs is not None:
                graphs.capture_all()

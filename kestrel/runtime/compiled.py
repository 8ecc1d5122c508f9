"""Opt-in ``torch.compile`` (inductor) of the decode step and of bucketed prefill forwards.

What compiles: ``decode.decode_static`` -- token embedding, every decoder layer, ``post_ln`` and
the vocabulary head -- as one graph per batch-size bucket, with static shapes
(``dynamic=False``) and no graph break (``fullgraph=True``). Inductor fuses the element-wise
work around the GEMMs (RoPE, the K/V page write, LayerNorm, bias + GELU, residual adds), which
eager mode launches op by op. Attention stays FlashAttention (or the torch reference): under
``torch.compile`` ``kestrel_kernels.paged_attention`` is the opaque op
``torch.ops.kestrel.paged_attention`` (``kestrel_kernels.compile_op``), one node per layer. The
forward's attention plan is traced once per forward as plain tensor ops, and the backend is
resolved while tracing, so no layer rebuilds it.

The compiled step is a drop-in for ``decode_static``: ``cuda_graphs.DecodeGraphs`` calls it in
its warm-up (where the compile happens, once per bucket) and captures it into its CUDA graph
like the eager step, so inductor's own CUDA graphs (``mode="reduce-overhead"``) are not used.

``CompiledPrefill`` pads a prefill group to a bucket shape (rows to a power of two, positions
to a multiple of ``position_bucket``) so a few graphs serve every prompt length; a Python int
that changes from call to call would otherwise recompile (see ``prefill_static``).

Off by default (``Engine(compile=True)``, ``kestrel ... --compile``) until a GPU run proves it;
the CPU tests prove the compiled step computes what the eager one does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import kestrel_kernels
from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV, text_forward
from kestrel.runtime.decode import decode_static
from kestrel.runtime.prefill import (
    PrefillItem,
    causal_rows,
    check_items,
    group_by_length,
    prefill_batch,
)
from kestrel_kernels.backends import AttentionBackend
from kestrel_kernels.batch import AttentionBatch, RowsLayout
from kestrel_kernels.graph_inputs import DecodeGraphInputs
from kestrel_kernels.segments import single_call_max_rows
from kestrel_kernels.transfer import upload

__all__ = [
    "CompileUnavailableError",
    "CompiledDecode",
    "CompiledPrefill",
    "check_compile",
    "compile_unavailable_reason",
    "prefill_static",
]

log = logging.getLogger("kestrel.runtime")

# Graphs one compiled function may hold: one per bucket (and grad mode), with room to spare.
RECOMPILE_LIMIT = 64


class CompileUnavailableError(RuntimeError):
    """``compile=True`` was asked for where ``torch.compile`` cannot build the step."""


def compile_unavailable_reason(device: torch.device | str) -> str | None:
    """Why inductor cannot compile for ``device`` here, or None when it can."""
    dev = torch.device(device)
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (dynamo) does not support this Python / platform"
    if dev.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs the triton package to compile for CUDA (pip install triton)"
        return None
    if dev.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as exc:  # no compiler found raises; the type varies by version
            return f"inductor needs a C++ compiler for CPU code ({type(exc).__name__}: {exc})"
        return None
    return f"compile is supported on cpu and cuda devices, not {dev.type}"


def check_compile(device: torch.device | str) -> None:
    """Raise ``CompileUnavailableError`` saying why, unless ``device`` can compile."""
    reason = compile_unavailable_reason(device)
    if reason is not None:
        raise CompileUnavailableError(f"compile=True cannot work here: {reason}")


class CompiledDecode:
    """``decode_static`` compiled by inductor, one graph per batch-size bucket.

    Called exactly like ``decode_static``; returns (hidden before post_ln [B, C], logits
    [B, V]). The first call of a bucket compiles (seconds for a tiny model, about a minute
    for Moondream 2); later calls run the compiled graph. ``compiler``: a dynamo backend
    (tests pass a recording one; serving keeps "inductor").
    """

    def __init__(
        self,
        step: Callable[..., tuple[Tensor, Tensor]] = decode_static,
        *,
        compiler: str | Callable = "inductor",
        fullgraph: bool = True,
    ) -> None:
        kestrel_kernels.prepare_compile()
        self._compiled = torch.compile(step, backend=compiler, dynamic=False, fullgraph=fullgraph)
        self._shapes: set[int] = set()

    @property
    def buckets(self) -> tuple[int, ...]:
        """Batch sizes this step has been called with (each is one compiled graph)."""
        return tuple(sorted(self._shapes))

    def __call__(
        self,
        model: MoondreamModel,
        kv: PagedKV,
        page_table_RP: Tensor,
        inputs: DecodeGraphInputs,
        override_BC: Tensor,
    ) -> tuple[Tensor, Tensor]:
        size = inputs.size
        if size not in self._shapes:
            log.info("compiling the decode step for batch %d (torch.compile, inductor)", size)
            self._shapes.add(size)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self._compiled(model, kv, page_table_RP, inputs, override_BC)


def prefill_static(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    x_BTC: Tensor,
    meta: Tensor,
    layout: RowsLayout,
    backend: AttentionBackend,
    causal_rows: int | None = None,
) -> Tensor:
    """One padded prefill forward as a pure function of tensors with static shapes.

    ``x_BTC``: the rows' new embeddings, zero-padded; ``meta``: the rows' int32 ``layout``
    block (``kestrel_kernels.batch.RowsLayout``: a padding row writes no page and reads page
    0). Returns the hidden state (before post_ln) of each row's last real position, ``[B, C]``.
    Unlike ``prefill._forward``, the page table is not cut to the longest prompt (a Python int
    that would recompile per prompt length): every row keeps its full width. ``causal_rows``:
    ``text_forward``'s bound on each row's queries outside its regions: None or
    ``segments.single_call_max_rows()`` only (two graphs at most, not one per question length).
    """
    rows = layout.views(meta)
    pages_BP = page_table_RP.index_select(0, rows.rows_B.long())
    attention = AttentionBatch.from_rows(
        rows, pages_BP, padded=True, causal_rows=causal_rows, backend=backend
    )
    hidden_BTC = text_forward(x_BTC, model.text, model.config.text, ForwardInputs(attention), kv)
    return hidden_BTC.reshape(layout.B * layout.T, -1).index_select(0, rows.last_B)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class CompiledPrefill:
    """``prefill.prefill_batch`` over ``prefill_static`` compiled by inductor, per bucket.

    Each length group (``prefill.group_by_length``) is padded to a bucket -- rows to a power of
    two, positions to a multiple of ``position_bucket`` -- so one graph serves every prompt of
    similar length; a bucket compiles on first use. A group with image blocks whose text after
    them fits the single-call attention plan gets it, with the bound fixed at its maximum.
    Groups with a LoRA adapter run the eager ``prefill_batch`` (adapters are host-side lists
    the compiled graph does not take).
    """

    def __init__(
        self,
        *,
        position_bucket: int = 64,
        compiler: str | Callable = "inductor",
        fullgraph: bool = True,
    ) -> None:
        if position_bucket < 1:
            raise ValueError(f"position_bucket must be >= 1, got {position_bucket}")
        self.position_bucket = position_bucket
        kestrel_kernels.prepare_compile()
        self._compiled = torch.compile(
            prefill_static, backend=compiler, dynamic=False, fullgraph=fullgraph
        )
        self._shapes: set[tuple[int, int, int]] = set()

    @property
    def buckets(self) -> tuple[tuple[int, int, int], ...]:
        """(rows, positions, regions) shapes compiled so far (regions: -1 = none)."""
        return tuple(sorted(self._shapes))

    def bucket(self, rows: int, positions: int) -> tuple[int, int]:
        """The padded (rows, positions) shape a group of ``rows`` x ``positions`` runs in."""
        return _pow2(rows), _round_up(positions, self.position_bucket)

    def prefill_batch(
        self,
        model: MoondreamModel,
        kv: PagedKV,
        page_table_RP: Tensor,
        items: Sequence[PrefillItem],
        backend: AttentionBackend,
    ) -> Tensor:
        """What ``prefill.prefill_batch`` returns, for the same arguments."""
        if not items or any(it.adapter is not None for it in items):
            return prefill_batch(model, kv, page_table_RP, items, backend)  # its checks, eagerly
        check_items(items)
        out = items[0].x_TC.new_empty(len(items), items[0].x_TC.shape[1])
        for group in group_by_length([it.n for it in items]):
            out[group] = self._forward([items[i] for i in group], model, kv, page_table_RP, backend)
        return out

    def _forward(
        self, items: Sequence[PrefillItem], model, kv, page_table_RP: Tensor,
        backend: AttentionBackend,
    ) -> Tensor:  # fmt: skip
        dev, dim = items[0].x_TC.device, items[0].x_TC.shape[1]
        B, T = self.bucket(len(items), max(it.n for it in items))
        layout = RowsLayout(B, T, max(len(it.regions) for it in items))
        meta = upload(layout.encode([it.span for it in items]), torch.int32, dev)
        x_BTC = items[0].x_TC.new_zeros(B, T, dim)
        for b, it in enumerate(items):
            x_BTC[b, : it.n] = it.x_TC
        bound, limit = None, single_call_max_rows()  # the single-call attention plan, where
        if layout.R and max(map(causal_rows, items)) <= limit:
            bound = limit  # every row's text after its image fits (one fixed bound: one graph)
        self._note((B, T, -1 if layout.R == 0 else 2 if layout.R == 1 else 3))
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            hidden_BC = self._compiled(
                model, kv, page_table_RP, x_BTC, meta, layout, backend, bound
            )
        return hidden_BC[: len(items)]

    def _note(self, shape: tuple[int, int, int]) -> None:
        if shape not in self._shapes:
            log.info("compiling prefill for %d rows x %d positions (torch.compile)", *shape[:2])
            self._shapes.add(shape)

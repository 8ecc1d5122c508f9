"""The batched decode forward: one new token per running sequence, over the paged KV.

Two forms of the same step:

- ``decode_eager``: built from host lists each step; the page table is cut to the longest row.
  Used on CPU, with the ``torch`` attention backend, and for batches with LoRA adapters.
- ``decode_static``: a pure function of device tensors with static shapes and no host
  synchronisation (embedding, full-width page-table rows, slots and key counts computed on the
  device), the form ``cuda_graphs.DecodeGraphs`` captures.

Moondream 3's MoE layers take one form in both (``moe.moe_mlp``: the chosen experts as grouped
GEMMs, shapes fixed by the batch size, no host synchronisation), which is what lets the step
be captured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV, embed_text, lm_head, text_forward
from kestrel_kernels.backends import AttentionBackend
from kestrel_kernels.batch import AttentionBatch

__all__ = ["decode_eager", "decode_static"]


def _one_step(model, kv, x_BC: Tensor, inputs: ForwardInputs) -> Tensor:
    """The decoder over one new position per row: hidden states before post_ln, [B, C]."""
    hidden_B1C = text_forward(x_BC[:, None, :], model.text, model.config.text, inputs, kv)
    return hidden_B1C[:, 0]


def decode_eager(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    x_BC: Tensor,
    rows: Sequence[int],
    lengths: Sequence[int],
    adapters: Sequence[LoraAdapter | None],
    backend: AttentionBackend | None,
) -> Tensor:
    """Hidden states before post_ln ``[B, C]``; row ``b``'s new K/V go to position ``lengths[b]``.

    ``page_table_RP``: the runtime's device page table ``[max_batch + 1, max_seq_len]``.
    """
    attention = AttentionBatch.decode_host(page_table_RP, rows, lengths, backend=backend)
    return _one_step(model, kv, x_BC, ForwardInputs.of(attention, adapters))


def decode_static(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    rows_B: Tensor,
    lengths_B: Tensor,
    ids_B: Tensor,
    override_B: Tensor,
    override_BC: Tensor,
    backend: AttentionBackend | None,
) -> tuple[Tensor, Tensor]:
    """One decode step for ``B`` rows: returns (hidden before post_ln [B, C], logits [B, V]).

    ``rows_B``: int64 batch rows (0 = the reserved padding row); ``lengths_B``: int64 KV length of
    each row before this step; ``ids_B``: int64 text token ids, embedded here; rows where the bool
    ``override_B`` is set take ``override_BC`` instead (coordinate / size embeddings). Padding
    rows get slot -1 (``write_kv`` skips it) and one key (page 0), and their outputs are
    meaningless.
    """
    x_BC = embed_text(ids_B, model.text)
    x_BC = torch.where(override_B[:, None], override_BC, x_BC)
    pages_BP = page_table_RP.index_select(0, rows_B)  # [B, max_seq_len]
    attention = AttentionBatch.decode(pages_BP, lengths_B, live_B=rows_B > 0, backend=backend)
    hidden_BC = _one_step(model, kv, x_BC, ForwardInputs(attention))
    return hidden_BC, lm_head(hidden_BC, model.text)

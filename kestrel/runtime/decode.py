"""The batched decode forward: one new token per running sequence, over the paged KV.

Two forms of the same step:

- ``decode_eager``: built from host lists each step; the page table is cut to the longest row.
  Used on CPU, with the ``torch`` attention backend, and for batches with LoRA adapters.
- ``decode_static``: a pure function of fixed device buffers (the backend's
  ``DecodeGraphInputs``) with static shapes and no host synchronisation (embedding, full-width
  page-table rows, slots and key counts computed on the device), the form
  ``cuda_graphs.DecodeGraphs`` captures.

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
from kestrel_kernels.graph_inputs import DecodeGraphInputs

__all__ = ["LANES", "OVERRIDES", "TOKEN_IDS", "decode_eager", "decode_static"]

TOKEN_IDS, OVERRIDES = 0, 1  # the decode graph inputs' lanes the step keeps its own values in
LANES = 2


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
    inputs: DecodeGraphInputs,
    override_BC: Tensor,
) -> tuple[Tensor, Tensor]:
    """One decode step for ``inputs.size`` rows: returns (hidden before post_ln [B, C],
    logits [B, V]).

    ``inputs``: the step's fixed attention inputs (``kestrel_kernels.graph_inputs``: each row's
    page-table row, 0 = the reserved padding row, and its KV length before this step), with
    two lanes of its own: the int64 text token ids, embedded here, and the override flags: rows
    whose flag is set take ``override_BC`` instead (coordinate / size embeddings). Padding rows
    get slot -1 (``write_kv`` skips it) and one key (page 0), and their outputs are
    meaningless.
    """
    x_BC = embed_text(inputs.lane(TOKEN_IDS), model.text)
    x_BC = torch.where(inputs.lane(OVERRIDES)[:, None] > 0, override_BC, x_BC)
    attention = inputs.batch(page_table_RP)
    hidden_BC = _one_step(model, kv, x_BC, ForwardInputs(attention))
    return hidden_BC, lm_head(hidden_BC, model.text)

"""The batched decode forward: one new token per running sequence, over the paged KV.

Two forms of the same step:

- ``decode_eager``: built from host lists each step; the page table is cut to the longest row.
  Used on CPU, with the ``torch`` attention backend, and for batches with LoRA adapters.
- ``decode_static``: a pure function of device tensors with static shapes and no host
  synchronisation (embedding, full-width page-table rows, slots and key counts computed on the
  device), the form ``cuda_graphs.DecodeGraphs`` captures.

Moondream 3's MoE layers run in their static form (``moe.moe_mlp_static``: no host
synchronisation, shapes fixed by the batch size) in ``decode_static`` always -- capture needs
it -- and in ``decode_eager`` on CUDA: the grouped form would stop the host once per MoE layer
per step to read the expert counts, and a decode step's few rows gain nothing from grouping.
On CPU, and in every prefill, the grouped form runs: it computes only the chosen experts
without copying their weights, and a host round trip costs nothing there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import PagedKV, embed_text, lm_head, text_forward
from kestrel_kernels.transfer import upload

__all__ = ["decode_eager", "decode_static"]


def _one_step(
    model, kv, x_BC, pages_BK, slots_B, lengths_B, lora, backend: str, moe_static: bool
) -> Tensor:
    """The decoder over one new position per row (KV length ``lengths_B`` before it): [B, C]."""
    hidden_B1C = text_forward(
        x_BC[:, None, :],
        model.text,
        model.config.text,
        positions_BT=lengths_B[:, None],
        kv=kv,
        slot_mapping=slots_B,
        page_table=pages_BK,
        seqused_k=(lengths_B + 1).to(torch.int32),
        lora=lora,
        backend=backend,
        moe_static=moe_static,
    )
    return hidden_B1C[:, 0]


def decode_eager(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    x_BC: Tensor,
    rows: Sequence[int],
    lengths: Sequence[int],
    adapters: Sequence[LoraAdapter | None],
    backend: str,
) -> Tensor:
    """Hidden states before post_ln ``[B, C]``; row ``b``'s new K/V go to position ``lengths[b]``.

    ``page_table_RP``: the runtime's device page table ``[max_batch + 1, max_seq_len]``.
    """
    dev = x_BC.device
    rows_B, lengths_B = upload([list(rows), list(lengths)], torch.int64, dev).unbind(0)
    max_k = max(lengths) + 1
    pages_BK = page_table_RP[rows_B, :max_k]
    slots_B = pages_BK.gather(1, lengths_B[:, None]).reshape(-1).to(torch.long)
    lora = list(adapters) if any(a is not None for a in adapters) else None
    static = x_BC.is_cuda  # see the module doc
    return _one_step(model, kv, x_BC, pages_BK, slots_B, lengths_B, lora, backend, static)


def decode_static(
    model: MoondreamModel,
    kv: PagedKV,
    page_table_RP: Tensor,
    rows_B: Tensor,
    lengths_B: Tensor,
    ids_B: Tensor,
    override_B: Tensor,
    override_BC: Tensor,
    backend: str,
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
    slots_B = pages_BP.gather(1, lengths_B[:, None])[:, 0].to(torch.int64)
    slots_B = torch.where(rows_B > 0, slots_B, -1)
    hidden_BC = _one_step(model, kv, x_BC, pages_BP, slots_B, lengths_B, None, backend, True)
    return hidden_BC, lm_head(hidden_BC, model.text)

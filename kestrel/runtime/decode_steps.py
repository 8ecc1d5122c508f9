"""The runtime's decode steps: one new position per running sequence, fed a known token or
(look-ahead) a token id still on the device.

``MoondreamRuntime`` holds one ``DecodeSteps`` (``runtime.decoder``) and hands its public
decode calls to it. It is given what a step needs: the model, the KV pool, the page table,
the runtime's running sequences (batch row -> state, read only) and the attention backend;
on CUDA also the ``DecodeGraphs`` it replays (``graphs``). See ``lookahead.py`` for how a
look-ahead position is settled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kestrel.kv.page_table import PagedKVCache, PageTable
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.text import embed_text, lm_head
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.decode import decode_eager
from kestrel.runtime.sequence import (
    PENDING,
    PromptToken,
    SequenceError,
    SequenceState,
    check_decode_batch,
)
from kestrel_kernels.backends import AttentionBackend

__all__ = ["DecodeSteps"]


class DecodeSteps:
    """Batched decode steps over the running sequences (held by ``MoondreamRuntime``)."""

    def __init__(
        self,
        model: MoondreamModel,
        kv: PagedKVCache,
        page_table: PageTable,
        running: Mapping[int, SequenceState],
        backend: AttentionBackend,
        graphs: DecodeGraphs | None,
    ) -> None:
        self.model, self.kv, self.page_table = model, kv, page_table
        self.running = running  # the runtime's: committed and not yet released
        self.backend = backend
        self.graphs = graphs  # replayed where every row runs the base model

    def decode_step(
        self, states: Sequence[SequenceState], tokens: Sequence[PromptToken]
    ) -> torch.Tensor:
        """Feed one token per sequence in one batched forward; returns logits [B, V].

        Each new K/V goes to that sequence's private page at its current length. Coordinate and
        size tokens are embedded through the region encoders.
        """
        check_decode_batch(states, tokens, self.running)
        hidden_BC, logits_BV = self.forward(states, tokens)
        for s, t, h in zip(states, tokens, hidden_BC.unbind(0), strict=True):
            s.length += 1
            s.fed.append(t)
            s.last_hidden = h
        return logits_BV

    def decode_ahead(
        self, states: Sequence[SequenceState], ids_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A look-ahead step: feed each sequence the text token whose id is ``ids_B[b]`` (int64,
        on the device; the host has not read it yet). Returns (hidden [B, C], logits [B, V]).

        Each position stays pending until ``settle_ahead`` confirms its token (the host read
        the same id and the skill fed it) or rolls it back (the next write goes there again).
        """
        check_decode_batch(states, None, self.running)
        hidden_BC, logits_BV = self.forward(states, None, ids_B)
        for s in states:
            s.length += 1
            s.fed.append(PENDING)
            s.ahead = True
        return hidden_BC, logits_BV

    def settle_ahead(
        self, state: SequenceState, token: PromptToken | None, hidden_C: torch.Tensor | None
    ) -> None:
        """Confirm a look-ahead position with the ``token`` fed there and its hidden state, or
        (``token`` None) roll it back."""
        if not state.ahead:
            raise SequenceError(f"sequence in batch row {state.batch_idx} has no look-ahead")
        state.ahead = False
        if token is None:
            state.fed.pop()
            state.length -= 1
        else:
            state.fed[-1] = token
            state.last_hidden = hidden_C

    def confirm_ahead(
        self,
        states: Sequence[SequenceState],
        tokens: Sequence[PromptToken],
        hidden_BC: torch.Tensor,
    ) -> None:
        """``settle_ahead`` confirming every row of a look-ahead step at once."""
        for s, t, h in zip(states, tokens, hidden_BC.unbind(0), strict=True):
            if not s.ahead:
                raise SequenceError(f"sequence in batch row {s.batch_idx} has no look-ahead")
            s.ahead = False
            s.fed[-1] = t
            s.last_hidden = h

    def forward(
        self,
        states: Sequence[SequenceState],
        tokens: Sequence[PromptToken] | None,
        ids_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model work of one decode step, fed ``tokens`` or the text ids ``ids_B`` (on the
        device): (hidden before post_ln [B, C], logits [B, V])."""
        adapters = [s.adapter for s in states]
        rows, lengths = [s.batch_idx for s in states], [s.length for s in states]
        if self.graphs is not None and all(a is None for a in adapters):
            return self.graphs.run(rows, lengths, tokens, ids_B)
        if ids_B is not None:
            x_BC = embed_text(ids_B, self.model.text)
        else:
            x_BC = embed_tokens(list(tokens), self.model)
        hidden_BC = decode_eager(
            self.model, self.kv, self.page_table.page_table, x_BC, rows, lengths,
            adapters, self.backend,
        )  # fmt: skip
        return hidden_BC, lm_head(hidden_BC, self.model.text)

"""Decode look-ahead: step t+1 is queued before the host has read step t's tokens.

A decode step ends with its tokens chosen on the device (``heads.choose``). Without look-ahead
the host then waits for them -- the device runs dry while the host reads the ids, advances every
skill, streams text and builds the next step. With look-ahead the executor first queues step
t+1, fed each row's chosen id straight from the device (``MoondreamRuntime.decode_ahead``), and
only then reads step t back: the device computes step t+1 while the host does its part of
step t. The read waits for step t's tokens only (an event behind their copy), never for an
empty queue.

Step t+1 guessed each row's next token: the id its draw chose. The skill decides for real once
the host has the ids, and the next ``decode`` call settles the guess row by row
(``settle``): a row fed exactly that text token keeps the look-ahead position and its
outputs; any other row (the skill stopped, fed a coordinate instead, finished its budget, or
was retired) rolls the position back, and a row still running is computed again with its real
token. On a GPU a wasted look-ahead row costs nothing extra (the batch shares the forward).

A row that ends does not feed its last token (``Skill`` returns None: the scheduler retires it
in the same step). Where the end is known before the ids are read -- the draw is ``final``: the
token is an answer's ``max_tokens``-th -- the row is left out of step t+1 (``BatchExecutor``
gathers the other rows' ids on the device), so it is fed exactly once per kept token. A row
whose device-chosen id is its stop token cannot be told apart before the read (that is what
the read is for), so it is queued, fed its stop token, and rolled back. Nothing of it leaks:
its write lands at its own next position, a private page past everything it may retain (the
cache-owned pages all lie before it); the release rolls the position back before the fed tokens
are inserted into the tree, so only positions fed by a real, confirmed step are cached; the
erase then frees the page, and one stream orders the pending write before any reuse.

The executor looks ahead only when every row of the step samples its next token from the logits
(``Skill.next_draw``) and the rows it queues have a page left; with every draw ``final`` there
is nothing to queue (at batch 1, the step after an answer's last token would be computed for
nothing). The scheduler asks for it only when no admission is due: a prefill between two steps
would leave its new rows out of the queued step, costing a second forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from kestrel.runtime.sequence import PromptToken, SequenceState
from kestrel.tokens import TextToken

__all__ = ["AheadStep", "LookaheadCounters", "settle"]


@dataclass(slots=True)
class LookaheadCounters:
    """Cumulative look-ahead figures of an executor: steps queued, rows fed in them, and how
    many of those rows were kept (the guess was right) or rolled back."""

    steps: int = 0
    rows: int = 0
    kept: int = 0
    rolled_back: int = 0


@dataclass(slots=True, eq=False)
class AheadStep:
    """A queued look-ahead step: its rows, outputs, and the ids it fed (read one step later)."""

    states: list[SequenceState]
    hidden_BC: Tensor
    logits_BV: Tensor
    fed_ids: list[int | None]

    @property
    def live(self) -> bool:
        """Whether any of its rows still waits to be settled."""
        return any(s.ahead for s in self.states)


def settle(
    runtime,
    ahead: AheadStep,
    handles: Sequence[SequenceState],
    tokens: Sequence[PromptToken],
    counters: LookaheadCounters,
) -> list[int]:
    """Settle ``ahead`` against the tokens the skills fed: per handle, the row of ``ahead``
    whose outputs it keeps, or -1 (not in it, or rolled back: it needs a fresh step). Rows of
    ``ahead`` that are not fed this step are rolled back too."""
    if list(handles) == ahead.states:  # the usual step: the same rows, in the same order
        ids = [t.token_id if type(t) is TextToken else None for t in tokens]
        if ids == ahead.fed_ids:  # and every guess right: confirm them all at once
            runtime.confirm_ahead(ahead.states, tokens, ahead.hidden_BC)
            counters.kept += len(ids)
            return list(range(len(ids)))
    where = {id(s): j for j, s in enumerate(ahead.states)}
    hidden = ahead.hidden_BC.unbind(0)
    used: list[int] = []
    for h, t in zip(handles, tokens, strict=True):
        j = where.pop(id(h), -1)
        if j >= 0 and h.ahead:
            kept = isinstance(t, TextToken) and t.token_id == ahead.fed_ids[j]
            runtime.settle_ahead(h, t if kept else None, hidden[j] if kept else None)
            j = j if kept else -1
        else:
            j = -1
        used.append(j)
    for j in where.values():
        s = ahead.states[j]
        if s.ahead and not s.released:
            runtime.settle_ahead(s, None, None)
    kept = sum(j >= 0 for j in used)
    counters.kept += kept
    counters.rolled_back += len(ahead.states) - kept
    return used

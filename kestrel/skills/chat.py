"""Chat: a conversation rendered as Moondream query blocks, answered by the query skill.

Moondream has no trained chat format, so a conversation is a sequence of query blocks, one per
user turn (the query template's pieces, see :mod:`kestrel.skills.prompts`)::

    [BOS] prefix + user_1 + [answer, answer] + reply_1
          prefix + user_2 + [answer, answer] + reply_2
          ...
          prefix + user_n + [answer, answer]          (or [answer, thinking] when reasoning)

Each user turn's images (``ImageToken``s, one 729-position block each) come first in its
block; the first turn's follow BOS, as for a query. A one-turn conversation is exactly the
query prompt, and turn n+1's prompt starts with turn n's prompt followed by its reply (the
generated ids when the engine remembers them), so the prefix cache, which retains each answer,
hits through every earlier turn. Decoding is the query skill's, reasoning and grounding
included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kestrel.skills.base import PromptToken, SkillOps
from kestrel.skills.prompts import PromptError, query_prompt
from kestrel.skills.settings import Settings
from kestrel.skills.text import QuerySkill
from kestrel.tokens import ImageToken, TextToken

__all__ = ["ChatSkill", "ChatTurn", "chat_prompt"]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One user message and the assistant's reply to it (None for the turn being answered).
    ``reply_ids``: the ids generated for ``reply`` (they decode to it), replayed instead of
    tokenizing the text so the prefix cache hits through the retained answer."""

    user: str
    reply: str | None = None
    reply_ids: tuple[int, ...] | None = None
    images: tuple[ImageToken, ...] = ()  # the user message's images, placed before its block


def chat_prompt(
    ops: SkillOps, turns: Sequence[ChatTurn], *, reasoning: bool = False
) -> list[PromptToken]:
    """The prompt tokens of a conversation whose last turn awaits its reply."""
    if not turns:
        raise PromptError("a conversation needs at least one user turn")
    if any(t.reply is None for t in turns[:-1]) or turns[-1].reply is not None:
        raise PromptError("every turn but the last must carry the assistant's reply")
    out: list[PromptToken] = []
    for i, turn in enumerate(turns):
        last = i == len(turns) - 1
        block = query_prompt(ops.tokens, ops.encode, turn.user, reasoning=last and reasoning)
        out.extend([*block[:1], *turn.images, *block[1:]] if i == 0 else [*turn.images, *block[1:]])
        if turn.reply:
            ids = turn.reply_ids if turn.reply_ids is not None else ops.encode(turn.reply)
            out.extend(TextToken(t) for t in ids)
    return out


class ChatSkill(QuerySkill):
    """Answer the last user turn of a conversation (the query skill over the chat prompt).
    The next turn attends to the answer: every answer token is fed, the last one too."""

    answer_continues = True

    def __init__(
        self,
        ops: SkillOps,
        turns: Sequence[ChatTurn],
        settings: Settings,
        *,
        reasoning: bool = False,
        record: bool = False,
        **answer: Any,
    ) -> None:
        """``answer``: the query skill's ``stop``, ``constraint`` and ``logprobs``."""
        self.turns = tuple(turns)
        if not self.turns:
            raise PromptError("a conversation needs at least one user turn")
        super().__init__(
            ops, self.turns[-1].user, settings, reasoning=reasoning, record=record, **answer
        )

    def _build_prompt(
        self, question: str, spatial: Sequence[PromptToken], reasoning: bool
    ) -> list[PromptToken]:
        return chat_prompt(self.ops, self.turns, reasoning=reasoning)

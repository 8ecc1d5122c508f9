"""Replies remembered by their text, so the next turn of a conversation replays the exact ids.

A chat reply goes back to the client as text, and the client sends that text back in the next
turn. Re-tokenizing it can give other ids than the ones generated (a tokenizer has several ways
to spell most strings), and the prefix cache, which retained the generated ids, would then miss
from the first difference on. :class:`ReplyMemory` keeps, per cache namespace (adapter, salt,
the conversation's first image), the ids of recent replies keyed by their decoded text; the
chat prompt uses them when the text comes back unchanged. The ids decode to that text by
construction, so the prompt means the same either way: an edited reply, or one the memory has
forgotten, is just tokenized. Bounded (LRU over namespaces and over replies in each).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import Any

from kestrel.skills import ChatTurn

__all__ = ["ReplyMemory"]


class ReplyMemory:
    """``text -> generated ids`` of recent replies, per namespace key; thread-safe."""

    def __init__(self, per_namespace: int = 64, namespaces: int = 256) -> None:
        if per_namespace < 1 or namespaces < 1:
            raise ValueError("ReplyMemory bounds must be >= 1")
        self.per_namespace, self.namespaces = per_namespace, namespaces
        self._lock = threading.Lock()
        self._spaces: OrderedDict[Hashable, OrderedDict[str, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._spaces.values())

    def remember(self, key: Hashable, text: str, ids: Sequence[int]) -> None:
        """Keep ``ids`` (which decode to ``text``) as the spelling of ``text`` in ``key``."""
        if not text or not ids:
            return
        with self._lock:
            space = self._spaces.get(key)
            if space is None:
                space = self._spaces[key] = OrderedDict()
                if len(self._spaces) > self.namespaces:
                    self._spaces.popitem(last=False)
            self._spaces.move_to_end(key)
            space[text] = tuple(int(i) for i in ids)
            space.move_to_end(text)
            if len(space) > self.per_namespace:
                space.popitem(last=False)

    def recall(self, key: Hashable, text: str) -> tuple[int, ...] | None:
        """The ids remembered for ``text`` in ``key``, or None."""
        with self._lock:
            space = self._spaces.get(key)
            ids = space.get(text) if space is not None else None
            if ids is not None:
                space.move_to_end(text)
            return ids

    def replay(self, key: Hashable, turns: Sequence[ChatTurn]) -> tuple[ChatTurn, ...]:
        """``turns`` with each remembered reply's generated ids attached."""
        out = []
        for turn in turns:
            ids = self.recall(key, turn.reply) if turn.reply else None
            out.append(turn if ids is None else replace(turn, reply_ids=ids))
        return tuple(out)

    def recording(self, key: Hashable, build: Callable[..., Any]) -> Callable[..., Any]:
        """``build`` (a draft's result builder) that remembers the reply it builds."""

        def build_and_remember(*args: Any) -> Any:
            result = build(*args)
            if getattr(args[0], "answer_spelled", True):  # (a stop string may cut a token)
                self.remember(key, result.content, result.tokens)
            return result

        return build_and_remember

"""Stop sequences: an answer cut at the first of the caller's strings, as OpenAI's ``stop``.

The answer's ids are detokenized as they arrive (``TextSink``) and the text is searched for
every stop string; the first match ends the answer with ``finish_reason`` "stop", and neither
the match nor anything after it is returned. A stream never shows text that might still turn
into a match: :meth:`StopText.take` holds back the longest tail of the text that is the start
of some stop string, and lets it go once the next pieces rule the match out (or the answer
ends without one).
"""

from __future__ import annotations

from collections.abc import Sequence

from kestrel.errors import InvalidInputError
from kestrel.skills.base import TextSink

__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "StopText", "parse_stop"]

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def parse_stop(value: object) -> tuple[str, ...]:
    """The stop strings of a call: None, one string, or a list of strings (each non-empty, at
    most ``MAX_STOP_CHARS`` characters, at most ``MAX_STOPS`` of them)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidInputError("stop must be a string or a list of strings")
    if len(items) > MAX_STOPS:
        raise InvalidInputError(f"at most {MAX_STOPS} stop strings, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidInputError(
                f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {s!r:.40}"
            )
    return tuple(dict.fromkeys(items))  # in order, without repeats


class StopText:
    """The answer's text as its ids arrive, cut at the first stop string (module doc).

    ``text``: what the answer says so far (the whole answer once :meth:`close` ran; up to the
    match after one). ``kept``: how many of the pushed ids contribute to ``text`` (after a
    match, those whose text starts before it).
    """

    __slots__ = ("_closed", "_longest", "_sent", "_sink", "_starts", "matched", "stops", "text")

    def __init__(self, sink: TextSink, stops: Sequence[str]) -> None:
        self._sink = sink
        self.stops = tuple(stops)
        self._longest = max(len(s) for s in self.stops)
        self.text = ""
        self.matched = False
        self._starts: list[int] = []  # where each pushed id's text starts in ``text``
        self._sent = 0  # characters handed out by ``take``
        self._closed = False

    def push(self, token_id: int) -> bool:
        """Add one id of the answer; True once a stop string has matched."""
        if self.matched:
            return True
        self._starts.append(len(self.text))
        self._add(self._sink.push(token_id))
        return self.matched

    def close(self) -> None:
        """The answer ended: what the detokenizer held back is text too (it may match)."""
        if not self._closed:
            self._closed = True
            if not self.matched:
                self._add(self._sink.flush())

    def _add(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - self._longest + 1)  # a new match ends in ``piece``
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.matched = True

    @property
    def kept(self) -> int:
        if not self.matched:
            return len(self._starts)
        end = len(self.text)
        return sum(1 for s in self._starts if s < end)

    @property
    def shown(self) -> int:
        """How many pushed ids have all or part of their text among what ``take`` gave."""
        return sum(1 for s in self._starts if s < self._sent)

    def held(self) -> int:
        """Characters at the end of ``text`` that are the start of some stop string."""
        if self.matched or self._closed:
            return 0
        text = self.text
        for k in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def take(self) -> str:
        """The text that became safe to show since the last call (module doc)."""
        end = len(self.text) - self.held()
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

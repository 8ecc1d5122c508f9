"""Text skills: query (plain and reasoning) and caption.

Token rules (the reference's, see docs/design.md "Numerics"): the id sampled from the prefill
logits is never masked; from the first decode step on, the answer marker is suppressed while
answering, eos and size while reasoning. Reasoning stops (without feeding) when it samples the
answer marker; then one answer marker is fed and the answer phase starts from its logits,
unmasked again. A coordinate token sampled while reasoning feeds the coordinate decoded from the
same hidden state instead of its embedding (grounded reasoning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kestrel.skills.base import Draw, PromptToken, Skill, SkillOps
from kestrel.skills.grounding import GroundingChunk, grounding_chunks
from kestrel.skills.prompts import caption_prompt, query_prompt
from kestrel.skills.settings import Settings
from kestrel.skills.stops import StopText
from kestrel.tokens import TextToken

if TYPE_CHECKING:
    from kestrel.moondream.config import TokenizerConfig

__all__ = [
    "CaptionSkill",
    "QuerySkill",
    "TextPhase",
    "answer_suppressed_ids",
    "reasoning_suppressed_ids",
]


def answer_suppressed_ids(tok: TokenizerConfig) -> tuple[int, ...]:
    """Suppressed while answering / captioning (the model was trained with a doubled marker)."""
    return (tok.answer_id,)


def reasoning_suppressed_ids(tok: TokenizerConfig) -> tuple[int, ...]:
    """Suppressed while reasoning: eos (reasoning ends on the answer marker) and size."""
    return (tok.eos_id, tok.size_id)


class TextPhase:
    """Sample until ``stop_id`` (not fed), ``max_tokens`` tokens, or the budget runs out.

    ``finish_reason``: "stop", "max_tokens" or "length" (no budget left to feed). With
    ``record`` the raw logits of every decision are kept (row 0: the phase's first logits).
    ``last``: nothing follows this phase, so its ``max_tokens``-th token ends it at once,
    unfed (a phase that something follows feeds it: what follows attends to it).
    ``constraint``: the grammar its tokens follow (``Draw.constraint``); ``logprobs`` >= 0:
    each kept token's log-probability and its ``logprobs`` most likely alternatives are
    recorded in ``token_logprobs`` (``(id, logprob, ((id, logprob), ...))``).
    """

    def __init__(
        self,
        ops: SkillOps,
        settings: Settings,
        rng: Any,
        *,
        stop_id: int,
        banned: tuple[int, ...],
        coord_id: int | None = None,
        record: bool = False,
        last: bool = False,
        constraint: Any = None,
        logprobs: int = -1,
    ) -> None:
        self.ops, self.settings, self.rng = ops, settings, rng
        self.stop_id, self.banned, self.coord_id, self.record = stop_id, banned, coord_id, record
        self.last = last
        self.constraint, self.logprobs = constraint, logprobs
        self.token_logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = []
        self.tokens: list[int] = []
        self.coords: list[tuple[int, float]] = []  # (index in tokens, decoded coordinate)
        self.step_logits: list[Any] = []
        self.first_logits: Any = None
        self.first_hidden: Any = None
        self.finish_reason: str | None = None
        self._draw: Draw | None = None
        self._greedy: Draw | None = None

    def next_draw(self) -> Draw:
        """The next decision's settings and uniform number (taken once per decision)."""
        if self._draw is None:
            s = self.settings
            banned = () if self.first_logits is None else self.banned
            final = self.last and len(self.tokens) + 1 >= s.max_tokens
            c, k = self.constraint, self.logprobs
            if s.temperature > 0 and self.rng is not None:
                u = self.rng.random()
                self._draw = Draw(s.temperature, s.top_p, banned, u, 0, final, c, k)
            else:  # greedy: the same draw every step after the first
                g = self._greedy
                if g is None or g.banned != banned or g.final != final:
                    self._greedy = Draw(s.temperature, s.top_p, banned, 0.0, 0, final, c, k)
                self._draw = self._greedy
        return self._draw

    def decide(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        draw = self._draw if self._draw is not None else self.next_draw()
        self._draw = None
        if self.first_logits is None:
            self.first_logits, self.first_hidden = logits_V, hidden_C
        if self.record:
            self.step_logits.append(logits_V)
        s = self.settings
        chosen = getattr(logits_V, "chosen", None)
        if chosen is not None and getattr(logits_V, "draw", None) is draw:
            tok = chosen  # the driver chose it under this very draw (see Skill.next_draw)
        elif draw.constraint is not None:
            tok = self.ops.sample(logits_V, s.temperature, s.top_p, draw.banned, self.rng,
                                  u=draw.u, constraint=draw.constraint)  # fmt: skip
        else:
            tok = self.ops.sample(logits_V, s.temperature, s.top_p, draw.banned, self.rng, u=draw.u)
        if tok == self.stop_id:
            self.finish_reason = "stop"
        elif len(self.tokens) >= s.max_tokens:
            self.finish_reason = "max_tokens"
        elif budget <= 0:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            return None
        self.tokens.append(tok)
        if self.constraint is not None:
            self.constraint.accept(tok)
        if self.logprobs >= 0:
            found = getattr(logits_V, "logprobs", None) if tok == chosen else None
            if found is None:  # not read with the batch: this row's own
                found = self.ops.logprobs(logits_V, tok, self.logprobs)
            self.token_logprobs.append((tok, *found))
        if self.last and len(self.tokens) >= s.max_tokens:  # the output is whole: not fed
            self.finish_reason = "max_tokens"
            return None
        if self.coord_id is not None and tok == self.coord_id:
            fed, _ = self.ops.coord_token(hidden_C)
            self.coords.append((len(self.tokens) - 1, fed.pos))
            return fed
        return TextToken(tok)


def _public_reason(reason: str | None) -> str:
    return "stop" if reason == "stop" else "length"


class _AnswerSkill(Skill):
    """A skill whose result is text from one answer phase (optionally after reasoning).

    ``answer_continues``: something later attends to the answer (a conversation's next turn),
    so even its last token is fed, and that turn hits through the whole answer; otherwise an
    answer cut at ``max_tokens`` ends unfed (``TextPhase``'s ``last``).

    ``stop``: strings that end the answer where they first appear (``stops.StopText``: the
    match is not part of the answer); ``constraint`` and ``logprobs``: the answer phase's
    (``TextPhase``)."""

    answer_continues = False

    def __init__(
        self,
        ops: SkillOps,
        settings: Settings,
        record: bool,
        *,
        stop: tuple[str, ...] = (),
        constraint: Any = None,
        logprobs: int = -1,
    ) -> None:
        self.ops, self.settings, self.record = ops, settings, record
        self.rng = ops.rng(settings.seed)
        tok = ops.tokens
        self.answer = TextPhase(
            ops,
            settings,
            self.rng,
            stop_id=tok.eos_id,
            banned=answer_suppressed_ids(tok),
            record=record,
            last=not self.answer_continues,
            constraint=constraint,
            logprobs=logprobs,
        )
        self._stops = StopText(ops.stream_decoder(), stop) if stop else None
        self._logprobs_taken = 0
        self.shaped = constraint is not None or logprobs >= 0
        # Text streams lazily: answer ids wait here until a consumer asks (take_text), so a
        # request nobody streams never runs the incremental detokenizer.
        self._sink = ops.stream_decoder()
        self._streamed = 0  # answer ids already pushed into the sink
        self._flushed = False

    @property
    def streams_text(self) -> bool:
        return True

    def _answer_step(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        phase, stops = self.answer, self._stops
        before = len(phase.tokens)
        fed = phase.decide(logits_V, hidden_C, budget)
        if stops is not None and len(phase.tokens) > before and stops.push(phase.tokens[-1]):
            fed = None  # a stop string matched: the answer ends here, its token unfed
            self._finish("stop")
        elif fed is None:
            self._finish(_public_reason(phase.finish_reason))
        if fed is None and stops is not None:
            stops.close()
        return fed

    def advance(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        return self._answer_step(logits_V, hidden_C, budget)

    def next_draw(self) -> Draw | None:
        return self.answer.next_draw()

    def take_text(self) -> str:
        if self._stops is not None:
            return self._stops.take()  # a stop string's possible start held back
        ids = self.answer.tokens
        parts = [self._sink.push(i) for i in ids[self._streamed :]]
        self._streamed = len(ids)
        if self.finished and not self._flushed:
            self._flushed = True
            parts.append(self._sink.flush())
        return "".join(parts)

    def output_tokens(self) -> tuple[int, ...]:
        """The answer's ids; after a stop string, those whose text starts before it."""
        ids = self.answer.tokens
        return tuple(ids if self._stops is None else ids[: self._stops.kept])

    def answer_text(self) -> str:
        if self._stops is not None:
            self._stops.close()
            return self._stops.text
        return self.ops.decode(self.answer.tokens)

    @property
    def answer_spelled(self) -> bool:
        """Whether ``output_tokens`` decode to ``answer_text`` exactly (not so when a stop
        string began inside a token: a conversation then re-tokenizes the reply)."""
        s = self._stops
        return s is None or not s.matched or self.ops.decode(self.output_tokens()) == s.text

    def take_logprobs(self) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
        """``answer_logprobs`` of the tokens streamed since the last call (a stream's text
        shown so far: a token held back by a stop string's possible start waits)."""
        found = self.answer.token_logprobs
        end = len(found) if self._stops is None else min(len(found), self._stops.shown)
        out = found[self._logprobs_taken : end]
        self._logprobs_taken = max(self._logprobs_taken, end)
        return out

    def answer_logprobs(self) -> list[tuple[int, float, tuple[tuple[int, float], ...]]] | None:
        """Each kept answer token's ``(id, logprob, top alternatives)`` (None: not asked)."""
        if self.answer.logprobs < 0:
            return None
        return self.answer.token_logprobs[: len(self.output_tokens())]


class QuerySkill(_AnswerSkill):
    """Answer a question, optionally reasoning first (grounded thoughts, then the answer)."""

    def __init__(
        self,
        ops: SkillOps,
        question: str,
        settings: Settings,
        *,
        reasoning: bool = False,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        record: bool = False,
        stop: tuple[str, ...] = (),
        constraint: Any = None,
        logprobs: int = -1,
    ) -> None:
        super().__init__(ops, settings, record, stop=stop, constraint=constraint, logprobs=logprobs)
        tok = ops.tokens
        spatial = ops.spatial_tokens(spatial_refs or ())
        self.prompt = self._build_prompt(question, spatial, reasoning)
        self.reasoning: TextPhase | None = None
        if reasoning:
            self.reasoning = TextPhase(
                ops,
                settings,
                self.rng,
                stop_id=tok.answer_id,
                banned=reasoning_suppressed_ids(tok),
                coord_id=tok.coord_id,
                record=record,
            )
        self._answering = not reasoning
        # reasoning tokens + one answer marker + answer tokens
        self.max_feeds = settings.max_tokens * (2 if reasoning else 1) + int(reasoning)

    def _build_prompt(
        self, question: str, spatial: Sequence[PromptToken], reasoning: bool
    ) -> list[PromptToken]:
        """The prompt this skill prefills (the chat skill renders a whole conversation)."""
        tok = self.ops.tokens
        return query_prompt(tok, self.ops.encode, question, spatial=spatial, reasoning=reasoning)

    def next_draw(self) -> Draw | None:
        phase = self.answer if self._answering else self.reasoning
        return None if phase is None else phase.next_draw()

    def advance(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        if self._answering and self._stops is not None:
            return self._answer_step(logits_V, hidden_C, budget)
        if self._answering:  # _answer_step, inlined: this runs for every row of every step
            fed = self.answer.decide(logits_V, hidden_C, budget)
            if fed is None:
                self._finish(_public_reason(self.answer.finish_reason))
            return fed
        assert self.reasoning is not None
        fed = self.reasoning.decide(logits_V, hidden_C, budget)
        if fed is not None:
            return fed
        if budget <= 0:  # no room for the answer marker
            self._finish("length")
            return None
        self._answering = True
        return TextToken(self.ops.tokens.answer_id)

    def reasoning_tokens(self) -> int:
        return 0 if self.reasoning is None else len(self.reasoning.tokens)

    def reasoning_output(self) -> tuple[str, tuple[GroundingChunk, ...]] | None:
        """The reasoning text and its grounded chunks (None without reasoning)."""
        if self.reasoning is None:
            return None
        return grounding_chunks(
            self.reasoning.tokens, dict(self.reasoning.coords), self.ops.tokens, self.ops.decode
        )


class CaptionSkill(_AnswerSkill):
    """Describe the image at one of the template's lengths ("short", "normal", "long")."""

    def __init__(
        self, ops: SkillOps, length: str, settings: Settings, *, record: bool = False
    ) -> None:
        super().__init__(ops, settings, record)
        self.prompt = caption_prompt(ops.tokens, length)
        self.max_feeds = settings.max_tokens

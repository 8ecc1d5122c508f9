"""The skill contract: one request's generation as a step-wise state machine.

A skill owns every token-level decision of one request and nothing else: its prompt, which
token is fed next, which ids are suppressed when, when to stop, and how the generated tokens
turn into a result. It never runs the model. A driver (the eager reference path, or the
engine's scheduler for a whole batch) prefills ``skill.prompt``, then loops::

    token = skill.advance(logits_V, hidden_C, budget)   # logits/hidden of the last position
    if token is None: break                              # finished; skill.finish_reason set
    logits_V, hidden_C = <feed token>                    # one decode step

``budget`` is how many more tokens the driver can feed (pages mapped / context left); a skill
that needs more finishes with ``"length"``. ``max_feeds`` is an upper bound on the tokens a
skill will ever feed, so the driver can reserve KV pages for the whole request up front.

Model-dependent operations (sampling, decoding a coordinate or size from a hidden state,
detokenizing) come through :class:`SkillOps`, so this package never imports model code and the
two drivers cannot drift.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kestrel.tokens import CoordToken, SizeToken, TextToken

if TYPE_CHECKING:
    from kestrel.moondream.config import TokenizerConfig

__all__ = ["Constraint", "Draw", "PromptToken", "Skill", "SkillOps", "TextSink"]

PromptToken = TextToken | CoordToken | SizeToken


class Draw(NamedTuple):
    """How a skill's next token will be chosen, announced before the logits exist, so a driver
    can choose the tokens of a whole batch on the device at once (``Skill.next_draw``).

    ``temperature`` 0 is greedy; ``banned`` ids are suppressed first; ``u`` in [0, 1) is the
    uniform number of the draw, taken from the request's own random stream. ``final``: the
    token it chooses ends the output and is never fed (the step after it would be wasted: a
    driver that computes steps ahead leaves such a row out). ``constraint``: the row's grammar
    (a :class:`Constraint`): only the tokens it allows now can be chosen. ``logprobs``: -1
    none; else the chosen token's log-probability and the ``logprobs`` most likely tokens'
    are read back with it.

    An immutable value, as a NamedTuple rather than a frozen dataclass: a sampled request
    makes one per token, for every row of every step, and a tuple is several times cheaper to
    build.
    """

    temperature: float
    top_p: float
    banned: tuple[int, ...] = ()
    u: float = 0.0
    top_k: int = 0
    final: bool = False
    constraint: Any = None
    logprobs: int = -1


class Constraint(Protocol):
    """A grammar the answer must follow (``kestrel.grammar.RowGrammar``): a driver asks it
    which tokens may come next, as a bitmask, before it chooses the row's token."""

    def fill(self, mask_W: Any) -> None:
        """Write the allowed next tokens into ``mask_W`` (int32 [ceil(V / 32)] on the host:
        bit ``i % 32`` of word ``i // 32`` set for an allowed id ``i``)."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the chosen token (raises for a token the grammar does not allow)."""
        ...


class TextSink(Protocol):
    """Incremental detokenizer: ``push`` ids, get the text that became final; ``flush`` the rest."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class SkillOps(Protocol):
    """What a skill needs from the model it runs on (implemented by the model package)."""

    @property
    def tokens(self) -> TokenizerConfig: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> TextSink: ...

    def sample(
        self,
        logits_V: Any,
        temperature: float,
        top_p: float,
        banned: Sequence[int],
        rng: Any,
        u: float | None = None,
    ) -> int:
        """One token id; ``banned`` ids are masked first; temperature 0 is argmax. ``u``: the
        draw's uniform number when the skill took it already (else drawn from ``rng``)."""
        ...

    def pick(self, logits_V: Any, ids: Sequence[int]) -> int:
        """The id of ``ids`` with the largest logit (the first listed wins a tie)."""
        ...

    def rng(self, seed: int | None) -> Any:
        """A random generator seeded with ``seed`` (None: the process-wide one)."""
        ...

    def coord_token(self, hidden_C: Any) -> tuple[CoordToken, Any]:
        """Greedy coordinate decoded from a hidden state, and the raw coordinate logits."""
        ...

    def size_token(self, hidden_C: Any) -> tuple[SizeToken, Any]:
        """Greedy (width, height) decoded from a hidden state, and the raw size logits."""
        ...

    def spatial_tokens(self, refs: Sequence[Sequence[float]]) -> list[CoordToken | SizeToken]:
        """Prompt tokens of spatial references (points / boxes in [0, 1])."""
        ...


class Skill(ABC):
    """One request's generation. Subclasses set ``prompt`` and ``max_feeds`` in __init__."""

    prompt: list[PromptToken]
    max_feeds: int
    finish_reason: str | None = None  # "stop" | "length" once finished
    shaped: bool = False  # its draws may carry a constraint or ask for logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def streams_text(self) -> bool:
        """Whether :meth:`take_text` yields the answer as it is generated."""
        return False

    def next_draw(self) -> Draw | None:
        """How the next :meth:`advance` will choose its token, if it samples one from the
        logits (None: it reads the logits otherwise, e.g. a region skill's decoders).

        A driver that chose the token itself may hand :meth:`advance` a logits object with
        ``draw`` (the very object returned here) and ``chosen`` (the id) attributes: the skill
        then takes ``chosen`` as its draw's outcome."""
        return None

    @abstractmethod
    def advance(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        """Decide from the last position's logits / hidden state: the next token to feed, or
        None when the request is finished."""

    def take_text(self) -> str:
        """Answer text that became final since the last call ("" for non-text skills)."""
        return ""

    @abstractmethod
    def output_tokens(self) -> tuple[int, ...]:
        """The id view of what was generated (the answer's ids; coord/size ids for regions)."""

    def reasoning_tokens(self) -> int:
        """How many tokens were generated while reasoning, before the answer (not among
        ``output_tokens``); 0 for a skill that does not reason."""
        return 0

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason

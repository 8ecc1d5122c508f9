"""Prompt token construction from the config's templates (reference behaviours reproduced).

Every builder returns cache tokens with BOS first: ``[BOS, ...]``. For an image prompt the
runtime places the ImageToken right after BOS (the seed's ``[BOS, Image, text...]``); for a
text-only query BOS is simply position 0.

- query:            prefix + spatial + question + [answer, answer]   (doubled marker, trained in)
                    Moondream 3 (``query_doubled_answer`` false): ... + [answer] once
- query, reasoning: prefix + spatial + question + [answer, thinking]; Moondream 3: + [thinking]
- caption(length):  the caption template (ends in a single answer marker)
- point / detect:   prefix + tokenize(" " + object) + suffix          (note the leading space)
The question is tokenized as given (no leading space).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kestrel.errors import InvalidInputError
from kestrel.tokens import CoordToken, SizeToken, TextToken

if TYPE_CHECKING:
    from kestrel.moondream.config import TokenizerConfig

__all__ = [
    "PromptError",
    "caption_prompt",
    "detect_prompt",
    "point_prompt",
    "query_prompt",
    "token_ids",
]

Encode = Callable[[str], list[int]]
PromptToken = TextToken | CoordToken | SizeToken


class PromptError(InvalidInputError):
    """A skill or option the model's templates do not support."""


def _template(tok: TokenizerConfig, skill: str) -> dict:
    t = tok.templates.get(skill)
    if t is None:
        raise PromptError(f"this model has no '{skill}' template")
    return t


def _text(ids: Sequence[int]) -> list[TextToken]:
    return [TextToken(int(i)) for i in ids]


def query_prompt(
    tok: TokenizerConfig,
    encode: Encode,
    question: str,
    *,
    spatial: Sequence[CoordToken | SizeToken] = (),
    reasoning: bool = False,
) -> list[PromptToken]:
    """[BOS] + query.prefix + spatial + encode(question) + then, Moondream 2: suffix +
    ([answer] | [thinking]); Moondream 3: suffix | [thinking]."""
    t = _template(tok, "query")
    tail = [tok.thinking_id] if reasoning else list(t["suffix"])
    if tok.query_doubled_answer:
        tail = [*t["suffix"], *tail]
    return [
        TextToken(tok.bos_id),
        *_text(t["prefix"]),
        *spatial,
        *_text(encode(question)),
        *_text(tail),
    ]


def caption_prompt(tok: TokenizerConfig, length: str) -> list[PromptToken]:
    """[BOS] + caption.<length> template."""
    t = _template(tok, "caption")
    if length not in t:
        raise PromptError(f"caption length must be one of {sorted(t)}, got {length!r}")
    return [TextToken(tok.bos_id), *_text(t[length])]


def _object_prompt(tok: TokenizerConfig, skill: str, encode: Encode, obj: str) -> list[PromptToken]:
    t = _template(tok, skill)
    if not obj.strip():
        raise PromptError(f"{skill} needs a non-empty object name")
    return [
        TextToken(tok.bos_id),
        *_text(t["prefix"]),
        *_text(encode(" " + obj)),
        *_text(t["suffix"]),
    ]


def point_prompt(tok: TokenizerConfig, encode: Encode, obj: str) -> list[PromptToken]:
    """[BOS] + point.prefix + encode(" " + obj) + point.suffix."""
    return _object_prompt(tok, "point", encode, obj)


def detect_prompt(tok: TokenizerConfig, encode: Encode, obj: str) -> list[PromptToken]:
    """[BOS] + detect.prefix + encode(" " + obj) + detect.suffix."""
    return _object_prompt(tok, "detect", encode, obj)


def token_ids(tokens: Sequence[PromptToken], tok: TokenizerConfig) -> list[int]:
    """The id view of a prompt: coordinates as coord_id, sizes as size_id (what the reference
    puts in its prompt before overwriting those rows' embeddings)."""
    out = []
    for t in tokens:
        if isinstance(t, TextToken):
            out.append(t.token_id)
        elif isinstance(t, CoordToken):
            out.append(tok.coord_id)
        elif isinstance(t, SizeToken):
            out.append(tok.size_id)
        else:
            raise TypeError(f"unexpected prompt token {type(t).__name__}")
    return out

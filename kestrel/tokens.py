"""Cache tokens: the units a prompt is keyed by in the radix prefix cache.

Each token type carries what the model needs to embed it (a text id, a coordinate value, a size
pair, an image hash) and a precomputed ``key``: the hashable, discrete part that identifies it in
the cache. Keys start with a distinct type tag, so a text id can never equal a coordinate bin.
Coordinates and sizes are keyed by their bins only (the float is what gets embedded; the bin is
what the model sampled, so two requests that sampled the same bin share KV).

``key`` is computed once at construction: the radix tree compares key tuples in its hot loop
instead of calling a method per token. ``TextToken(i)`` returns one shared instance per id (they
are frozen values), so a prompt costs no allocation per token and equal keys compare by identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TEXT_TAG = 0
COORD_TAG = 1
SIZE_TAG = 2
IMAGE_TAG = 3

__all__ = [
    "COORD_TAG",
    "IMAGE_TAG",
    "SIZE_TAG",
    "TEXT_TAG",
    "CacheToken",
    "CoordToken",
    "ImageToken",
    "SizeToken",
    "TextToken",
    "cache_keys",
    "kv_length",
]


def _check_index(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


_INTERN_BELOW = 1 << 17  # bounds the shared instances by the vocabulary, whatever callers pass
_TEXT_TOKENS: dict[int, TextToken] = {}


class _SharedPerId(type):
    """``TextToken(i)`` returns one shared instance per id (tokens are frozen values): building
    a prompt allocates nothing per token, equal tokens compare by identity first, and evicting
    a cached prompt frees no token objects."""

    def __call__(cls, token_id):
        tok = _TEXT_TOKENS.get(token_id) if type(token_id) is int else None
        if tok is None:
            tok = super().__call__(token_id)  # validates
            if token_id < _INTERN_BELOW:
                _TEXT_TOKENS[token_id] = tok
        return tok


@dataclass(frozen=True, slots=True)
class TextToken(metaclass=_SharedPerId):
    """One vocabulary token: one KV position."""

    token_id: int
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_index("token_id", self.token_id)
        object.__setattr__(self, "key", (TEXT_TAG, self.token_id))

    def cache_key(self) -> tuple:
        return self.key

    def kv_length(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class CoordToken:
    """A coordinate fed back through the region encoder: ``pos`` is embedded, ``bin`` is keyed."""

    pos: float
    bin: int
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_index("bin", self.bin)
        object.__setattr__(self, "key", (COORD_TAG, self.bin))

    def cache_key(self) -> tuple:
        return self.key

    def kv_length(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class SizeToken:
    """A (width, height) pair fed back through the size encoder; keyed by its two bins."""

    width: float
    height: float
    width_bin: int
    height_bin: int
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_index("width_bin", self.width_bin)
        _check_index("height_bin", self.height_bin)
        object.__setattr__(self, "key", (SIZE_TAG, self.width_bin, self.height_bin))

    def cache_key(self) -> tuple:
        return self.key

    def kv_length(self) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class ImageToken:
    """A whole image as one cache token spanning ``kv_length_`` KV positions.

    ``content_hash`` is the first 128 bits of the image's SHA-256 (see design.md 3.5); the KV
    length is part of the key so a model with a different image token count never matches.
    """

    content_hash: int
    kv_length_: int
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_index("content_hash", self.content_hash)
        if isinstance(self.kv_length_, bool) or not isinstance(self.kv_length_, int):
            raise ValueError(f"kv_length_ must be an int, got {self.kv_length_!r}")
        if self.kv_length_ < 1:
            raise ValueError(f"kv_length_ must be >= 1, got {self.kv_length_}")
        object.__setattr__(self, "key", (IMAGE_TAG, self.content_hash, self.kv_length_))

    def cache_key(self) -> tuple:
        return self.key

    def kv_length(self) -> int:
        return self.kv_length_


CacheToken = TextToken | CoordToken | SizeToken | ImageToken


def cache_keys(tokens: list[CacheToken] | tuple[CacheToken, ...]) -> tuple[tuple, ...]:
    """The key tuple of a token sequence (what the radix tree compares)."""
    return tuple(t.key for t in tokens)


def kv_length(tokens: list[CacheToken] | tuple[CacheToken, ...]) -> int:
    """Total KV positions (= pages, page_size 1) a token sequence occupies."""
    return sum(t.kv_length() for t in tokens)

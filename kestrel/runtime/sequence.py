"""Per-sequence state of the cached runtime and the prompt -> cache-token mapping.

Kept apart from the runtime so the bookkeeping (what a sequence owns, which part of its prompt is
cacheable) can be read and tested without the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kestrel.images import PreparedImage, prepare_image
from kestrel.prefix_cache.lease import LeasePhase
from kestrel.prefix_cache.namespace import CacheNamespace
from kestrel.tokens import IMAGE_TAG, CoordToken, ImageToken, SizeToken, TextToken

if TYPE_CHECKING:
    import torch

    from kestrel.moondream.config import MoondreamConfig
    from kestrel.moondream.lora import LoraAdapter
    from kestrel.prefix_cache.lease import CacheLease
    from kestrel.prefix_cache.node import TreeNode

__all__ = [
    "PENDING",
    "PromptToken",
    "RuntimeCounters",
    "SequenceError",
    "SequenceState",
    "build_cache_tokens",
    "cacheable_prefix",
    "check_decode_batch",
    "check_request",
    "image_regions",
    "images_to_encode",
    "prepared_images",
    "validate_image_regions",
]

PromptToken = TextToken | CoordToken | SizeToken


class _Pending:
    """The placeholder of a look-ahead position in ``SequenceState.fed``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PENDING"


PENDING = _Pending()


class SequenceError(ValueError):
    """A request the runtime cannot run as given (bad tokens, too long, released twice...)."""


@dataclass(slots=True, eq=False)
class SequenceState:
    """One sequence, from ``prepare_sequence`` to ``release_sequence``.

    Ownership lives in ``lease`` (the batch row, its pages, the one cache lock; see
    ``kestrel/prefix_cache/lease.py``): the first ``cache_owned_page_count`` pages of the row
    belong to the cache tree (``reused_page_count`` of them were reused at start, the rest were
    inserted by this sequence); every page after them is private to this row and is freed by
    ``release_sequence``. The sequence holds exactly one lock, on ``cache_lock_node`` (None
    when the cache is off). ``prompt`` and ``images`` are kept only until the prefill.
    ``fed`` lists the tokens fed by ``decode_step``, one per KV position written after the
    prompt (``len(fed) == length - prompt_length``); the release may retain them in the cache.
    ``ahead``: the last position was fed by a look-ahead step (``decode_ahead``) with a token
    the host has not read yet; ``fed`` ends with ``PENDING`` until it is confirmed or rolled
    back.
    """

    lease: CacheLease
    namespace: CacheNamespace
    length: int = 0  # KV positions written so far
    adapter: LoraAdapter | None = None
    last_hidden: torch.Tensor | None = None  # [dim] decoder output (pre post_ln) of the last step
    image_regions: list[tuple[int, int]] = field(default_factory=list)
    cache_tokens: list = field(default_factory=list)
    prompt: tuple[PromptToken, ...] = ()
    images: tuple[PreparedImage, ...] = ()
    fed: list[PromptToken] = field(default_factory=list)
    embedding_hits: int = 0  # images the prefill took from the embedding tier
    image_encodes: int = 0  # images the prefill encoded
    host_pages: int = 0  # reused pages copied back from the host KV tier
    released: bool = False
    ahead: bool = False
    # the lease's row and length budget, fixed once prepared; plain fields, read every step
    batch_idx: int = field(init=False)
    max_length: int = field(init=False)  # pages mapped for this row: prompt + max_new_tokens

    def __post_init__(self) -> None:
        self.batch_idx = self.lease.row
        self.max_length = self.lease.max_length

    @property
    def prompt_length(self) -> int:
        return self.lease.prompt_length

    @property
    def reused_page_count(self) -> int:
        return self.lease.skip

    @property
    def cache_owned_page_count(self) -> int:
        return self.lease.cache_owned

    @property
    def vision_encoded(self) -> bool:
        """Whether the prefill ran the vision encoder (for at least one image)."""
        return self.image_encodes > 0

    def images_computed(self) -> list[bool]:
        """For each image: does the prefill compute it (its block ends past the reused
        positions)? If not, it is served from the cache."""
        return [end > self.reused_page_count for _start, end in self.image_regions]

    @property
    def cache_lock_node(self) -> TreeNode | None:
        return self.lease.lock_node

    def check_running(self, mapped: int, cache_on: bool) -> None:
        """A running sequence's invariants (``mapped``: the positions its row maps): committed,
        one live lock (with the cache on), its whole budget mapped, one fed token recorded
        per decoded position (what release retains)."""
        i, lease = self.batch_idx, self.lease
        if lease.phase is not LeasePhase.COMMITTED or self.released:
            raise AssertionError(f"running sequence {i} is {lease.phase.value}")
        node = self.cache_lock_node  # raises when the lease holds more than one lock
        if cache_on and node is None:
            raise AssertionError(f"running sequence {i} holds no cache lock")
        if node is not None and (node.lock_ref < 1 or node.detached):
            raise AssertionError(f"sequence {i} locks a node with lock_ref 0")
        if mapped != self.max_length:
            raise AssertionError(f"row {i} maps {mapped} != {self.max_length}")
        decoded = self.length - self.prompt_length
        pending = [i for i, t in enumerate(self.fed) if t is PENDING]
        if pending != ([len(self.fed) - 1] if self.ahead else []):
            raise AssertionError(
                f"row {i} has look-ahead placeholders at {pending} (ahead={self.ahead}): only "
                "the last fed position may wait for its token"
            )
        if len(self.fed) != decoded:
            raise AssertionError(
                f"row {i} recorded {len(self.fed)} fed tokens for {decoded} decoded positions "
                "(retention would misplace KV)"
            )

    @property
    def cache_tier(self) -> str:
        """Which tier served the prompt: ``"embedding"`` (an image it computed came from the
        embedding tier and none was encoded), ``"host"`` / ``"kv"`` (reused KV, some of it
        copied back from host memory / all of it on the device), else ``"none"``."""
        if self.embedding_hits and not self.image_encodes:
            return "embedding"
        if self.image_encodes or not self.reused_page_count:
            return "none"
        return "host" if self.host_pages else "kv"

    @property
    def remaining(self) -> int:
        """Tokens that can still be fed before the row's pages run out."""
        return self.max_length - self.length


def prepared_images(image: object) -> tuple[PreparedImage, ...]:
    """``image`` (None, one image or a tuple of them) as prepared images: the Engine passes
    them decoded and hashed; anything else is prepared here, once."""
    if image is None:
        return ()
    items = image if isinstance(image, tuple) else (image,)
    return tuple(im if isinstance(im, PreparedImage) else prepare_image(im) for im in items)


def images_to_encode(states: Sequence[SequenceState]) -> list[tuple[str | None, PreparedImage]]:
    """(salt, image) of every image the prefill of ``states`` computes."""
    return [
        (s.namespace.salt, image)
        for s in states
        for image, computed in zip(s.images, s.images_computed(), strict=True)
        if computed
    ]


def validate_image_regions(regions: Sequence[tuple[int, int]], config: MoondreamConfig) -> None:
    """Image blocks: in order, disjoint, each ``image_tokens`` positions; only the first may
    start at 0 (BOS joins the block of an image that directly follows it)."""
    n, prev = config.image_tokens, 0
    for i, (start, end) in enumerate(regions):
        bos = start == 0 and i == 0
        if start < prev or end - start != n + int(bos) or (start == 0 and not bos):
            raise SequenceError(
                f"image_regions must be ordered, disjoint blocks of {n} positions (BOS joins "
                f"a first image right after it), got {list(regions)}"
            )
        prev = end


def image_regions(cache_tokens: Sequence) -> list[tuple[int, int]]:
    """The bidirectional block ``(start, end)`` of each image, in KV positions; an image right
    after BOS takes BOS into its block (``(0, 1 + n)``), as Moondream was trained."""
    out, pos = [], 0
    for tok in cache_tokens:
        n = tok.kv_length()
        if isinstance(tok, ImageToken):
            out.append((0, pos + n) if pos == 1 else (pos, pos + n))
        pos += n
    return out


def build_cache_tokens(tokens: Sequence, image_hashes: Sequence[int], image_tokens: int) -> list:
    """The prompt's cache tokens. A prompt that places its images itself (``ImageToken``s in
    ``tokens``, one per image, in order) is its own; otherwise its one image goes right after
    BOS: ``[BOS, ImageToken(hash, image_tokens), text...]`` (nothing for text-only)."""
    placed = [t for t in tokens if isinstance(t, ImageToken)]
    if placed:
        if [t.key for t in placed] != [(IMAGE_TAG, h, image_tokens) for h in image_hashes]:
            raise SequenceError(
                f"the prompt places {len(placed)} image(s) that are not the {len(image_hashes)} "
                f"given ({image_tokens} positions each, in order)"
            )
        return list(tokens)
    out: list = [tokens[0]]
    if len(image_hashes) > 1:
        raise SequenceError("a prompt with several images must place them (ImageToken)")
    out.extend(ImageToken(h, image_tokens) for h in image_hashes)
    out.extend(tokens[1:])
    return out


def _canonical(tok: object, coord_bins: int, size_bins: int) -> bool:
    """Whether a token's embedding is fully determined by its cache key.

    Coordinates and sizes are keyed by their bins, but embedded from their float values. A token
    is only safe to share when its float is the one its bin decodes to (``bin / coord_bins`` for
    coordinates, the log-scale value for sizes); user-given spatial references in prompts are
    usually off-grid, and two of them in the same bin must not share KV.
    """
    if isinstance(tok, CoordToken):
        return tok.pos == tok.bin / coord_bins
    if isinstance(tok, SizeToken):

        def value(b: int) -> float:
            return 2.0 ** (b / (size_bins - 1) * 10 - 10)

        return tok.width == value(tok.width_bin) and tok.height == value(tok.height_bin)
    return True


def cacheable_prefix(cache_tokens: Sequence, coord_bins: int, size_bins: int) -> int:
    """Number of leading cache tokens that may be matched and inserted: everything up to the
    first coordinate/size token whose float is off its bin's grid (a prompt's, or a decoded
    one fed back from the region decoder's continuous output)."""
    for i, tok in enumerate(cache_tokens):
        if not _canonical(tok, coord_bins, size_bins):
            return i
    return len(cache_tokens)


def check_request(
    config: MoondreamConfig,
    tokens: Sequence[PromptToken | ImageToken],
    n_images: int,
    max_new_tokens: int,
) -> None:
    """Validate a ``start_sequence`` request (before anything is decoded or taken): ``tokens``
    may place its ``n_images`` images itself (``ImageToken``s), else one goes after BOS."""
    if not tokens or not isinstance(tokens[0], TextToken):
        raise SequenceError("a prompt must start with TextToken(bos_id)")
    if tokens[0].token_id != config.tokenizer.bos_id:
        raise SequenceError(
            f"a prompt must start with BOS ({config.tokenizer.bos_id}), got {tokens[0]!r}"
        )
    for t in tokens:
        if not isinstance(t, PromptToken | ImageToken):
            raise SequenceError(f"prompt tokens must be Text/Coord/Size/Image tokens, got {t!r}")
        if isinstance(t, TextToken) and t.token_id >= config.text.vocab_size:
            raise SequenceError(f"token id {t.token_id} >= vocab size {config.text.vocab_size}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise SequenceError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise SequenceError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    placed = sum(isinstance(t, ImageToken) for t in tokens)
    if placed not in (0, n_images) or (not placed and n_images > 1):
        raise SequenceError(f"the prompt places {placed} images but {n_images} were given")
    if n_images and len(tokens) - placed < 2:
        raise SequenceError("an image prompt needs at least one token after BOS")
    prompt = len(tokens) - placed + config.image_tokens * n_images
    if prompt + max_new_tokens > config.text.max_context:
        raise SequenceError(
            f"prompt ({prompt} positions) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model context of {config.text.max_context}"
        )


_TOKEN_TYPES = (TextToken, CoordToken, SizeToken)


def check_decode_batch(
    states: Sequence[SequenceState],
    tokens: Sequence | None,
    active: Mapping[int, SequenceState],
) -> None:
    """Refuse a decode step unless every sequence is running (``active`` maps batch rows to
    running sequences), has a page left, appears once, and is fed a cache token (``tokens``
    None: text ids on the device, a look-ahead step). One pass of plain attribute checks: it
    runs on every step."""
    if tokens is None:
        tokens = (TextToken(0),) * len(states)
    if len(states) != len(tokens) or not states:
        raise SequenceError(
            f"decode_step needs one token per sequence, got {len(states)} states and "
            f"{len(tokens)} tokens"
        )
    for s, t in zip(states, tokens, strict=True):
        if s.released or active.get(s.batch_idx) is not s:
            raise SequenceError(f"sequence in batch row {s.batch_idx} is not running")
        if s.length >= s.max_length:
            raise SequenceError(
                f"sequence in batch row {s.batch_idx} has used all "
                f"{s.max_length - s.prompt_length} new-token pages (max_new_tokens reached)"
            )
        if s.ahead:
            raise SequenceError(
                f"sequence in batch row {s.batch_idx} has an unsettled look-ahead position"
            )
        if not isinstance(t, _TOKEN_TYPES):
            raise SequenceError(f"decode_step tokens must be cache tokens, got {t!r}")
    if len({s.batch_idx for s in states}) != len(states):
        raise SequenceError("a sequence appears twice in one decode_step")


@dataclass(slots=True)
class RuntimeCounters:
    """Cumulative figures of a runtime's sequences, for metrics and benchmarks."""

    sequences: int = 0
    prompt_tokens: int = 0  # KV positions of all prompts
    cached_tokens: int = 0  # of which reused from the cache
    prefill_tokens: int = 0  # of which computed
    vision_encodes: int = 0  # sequences whose prefill ran the vision encoder
    encoder_runs: int = 0  # vision encoder calls (one per image encoded)
    embedding_hits: int = 0  # images taken from the embedding tier instead
    cache_hits: int = 0  # sequences that reused at least one page
    retained_tokens: int = 0  # decoded positions kept in the cache at release

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, state: SequenceState) -> None:
        """Count a sequence that has just been prefilled and committed."""
        self.sequences += 1
        self.prompt_tokens += state.prompt_length
        self.cached_tokens += state.reused_page_count
        self.prefill_tokens += state.prompt_length - state.reused_page_count
        self.vision_encodes += int(state.vision_encoded)
        self.embedding_hits += state.embedding_hits
        self.cache_hits += int(state.reused_page_count > 0)

"""The Moondream 2 tokenizer ("starmie", byte-level BPE) and incremental detokenization.

The reference prepends BOS and the prompt templates itself and uses ``encode(text).ids``
verbatim, so :meth:`MoondreamTokenizer.encode` must never add special tokens: it encodes with
``add_special_tokens=False``, which is identical to ``.encode(text).ids`` for starmie (its
post-processor adds nothing) and still correct for a tokenizer whose post-processor would add
BOS/EOS. Decoding skips special tokens by default, as the reference does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from .hub import CheckpointError, download_snapshot, looks_like_repo_id

__all__ = ["DEFAULT_TOKENIZER_REPO", "MoondreamTokenizer", "StreamDecoder", "TokenizerError"]

# The hub repo the reference always loads the MD2 tokenizer from.
DEFAULT_TOKENIZER_REPO = "moondream/starmie-v1"
TOKENIZER_FILE = "tokenizer.json"

# Replacement character: what a decode ending in an incomplete UTF-8 sequence ends with.
_REPLACEMENT = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded, or ids outside its vocabulary."""


class MoondreamTokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with the reference's encode/decode rules."""

    __slots__ = ("_tok", "vocab_size")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> MoondreamTokenizer:
        """Load a ``tokenizer.json`` file."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise TokenizerError(f"no tokenizer file at {path} (expected a tokenizer.json)")
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust loader raises a plain Exception subclass
            raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from exc

    @classmethod
    def from_dir(cls, directory: str | Path) -> MoondreamTokenizer:
        """Load ``tokenizer.json`` from a model directory."""
        return cls.from_file(Path(directory).expanduser() / TOKENIZER_FILE)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path = DEFAULT_TOKENIZER_REPO, revision: str | None = None
    ) -> MoondreamTokenizer:
        """A local directory or tokenizer.json, else a hub repo (default ``moondream/starmie-v1``).

        Hub downloads need huggingface_hub; offline or without it a CheckpointError explains how
        to pass a local tokenizer.json instead.
        """
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            return cls.from_dir(path)
        if path.is_file():
            return cls.from_file(path)
        if isinstance(name_or_path, Path) or not looks_like_repo_id(str(name_or_path)):
            raise TokenizerError(f"no tokenizer at {path} (a directory or a tokenizer.json)")
        snapshot = download_snapshot(
            str(name_or_path),
            revision=revision,
            allow_patterns=[TOKENIZER_FILE],
            what=TOKENIZER_FILE,
        )
        if not (snapshot / TOKENIZER_FILE).is_file():
            raise CheckpointError(f"hub repo {name_or_path!r} has no {TOKENIZER_FILE}")
        return cls.from_dir(snapshot)

    @classmethod
    def for_checkpoint(
        cls, checkpoint: str | Path, fallback: str | Path = DEFAULT_TOKENIZER_REPO
    ) -> MoondreamTokenizer:
        """The tokenizer of a local checkpoint: its ``tokenizer.json`` when it ships one (test
        checkpoints do), else ``fallback`` (the official checkpoint uses the starmie tokenizer,
        which lives in its own hub repo)."""
        path = Path(checkpoint).expanduser()
        directory = path if path.is_dir() else path.parent
        if (directory / TOKENIZER_FILE).is_file():
            return cls.from_dir(directory)
        return cls.from_pretrained(fallback)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special token added."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 byte sequences decode to U+FFFD."""
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(
                f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for: a byte-level token's own bytes (a piece of a
        multi-byte character stays a piece), a special token's name as UTF-8."""
        token = self._tok.id_to_token(int(token_id))
        if token is None:
            raise TokenizerError(f"token id {token_id} outside the vocabulary")
        table = _byte_level_table()
        if all(c in table for c in token):
            return bytes(table[c] for c in token)
        return token.encode()

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar engines build from)."""
        return self._tok.to_str()

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``): each of the 256 bytes as the
    printable character that stands for it in the vocabulary, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class StreamDecoder:
    """Incremental detokenization for streaming: ``push`` ids one at a time, get new text.

    Contract: ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids)``, and no
    returned piece ends in half a multi-byte character: while the decoded tail ends in U+FFFD
    (an incomplete UTF-8 sequence, e.g. an emoji split over byte tokens) the text is held back
    until a later token completes it, or until :meth:`flush`. Each push decodes only the ids
    since the last emitted piece (plus that piece, as context for the decoder), so a stream of n
    tokens costs O(n) decode work when text flows.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tok")

    def __init__(self, tokenizer: MoondreamTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the already-emitted context window
        self._read = 0  # ids before this are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Append one id; return the text that became final (may be empty)."""
        token_id = int(token_id)
        if not 0 <= token_id < self._tok.vocab_size:
            raise TokenizerError(
                f"token id {token_id} outside the vocabulary [0, {self._tok.vocab_size})"
            )
        self._ids.append(token_id)
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """Return everything held back (possibly ending in U+FFFD) and mark it emitted."""
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(seen) :]

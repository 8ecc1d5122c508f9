"""Grammars compiled with llguidance for one tokenizer, and each request's own matcher.

llguidance (the ``structured`` extra) was chosen over xgrammar by measuring both on a
51,200-id byte-level BPE vocabulary (docs/structured.md): its JSON never lets a raw control
character into a string (xgrammar 0.2.9's ``maxLength`` strings did, 4 answers in 5 invalid
JSON), it builds straight from ``tokenizer.json`` with the special tokens kept out of every
grammar, and it installs nothing else; xgrammar fills a mask faster, but llguidance's ~20 us
a row is inside the budget.

:class:`Grammars` belongs to an engine: the llguidance tokenizer is built on the first
constrained call (~0.35 s at 51,200 ids), each spec is compiled once into a pristine matcher
(kept in an LRU by ``GrammarSpec.key``, bounded in count and in the bytes of the grammars'
text, ``CACHED_GRAMMARS`` and ``CACHED_GRAMMAR_BYTES``: a compiled grammar's size grows with its
text), and a request gets a copy of it (~1 us), a :class:`RowGrammar`. A grammar that cannot
be compiled raises ``InvalidInputError`` on the caller's thread, before anything is queued.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kestrel.errors import InvalidInputError, UnsupportedError
from kestrel.grammar.spec import GrammarSpec

__all__ = [
    "CACHED_GRAMMARS",
    "CACHED_GRAMMAR_BYTES",
    "GrammarError",
    "Grammars",
    "RowGrammar",
    "grammar_text",
]

CACHED_GRAMMARS = 256
CACHED_GRAMMAR_BYTES = 32 << 20  # of grammar text; a larger grammar is compiled, not kept
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no runs of blank space


class GrammarError(RuntimeError):
    """The model chose a token its grammar did not allow (a masking fault, never expected)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise UnsupportedError(
            "response_format needs llguidance: pip install 'kestrel[structured]'"
        ) from None
    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (not yet checked)."""
    matcher = _llguidance().LLMatcher
    if spec.is_json:
        return matcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return matcher.grammar_from_regex(spec.source)
    choices = json.loads(spec.source)  # each a Lark string literal, JSON-escaped
    return matcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    )


class RowGrammar:
    """One request's place in its grammar: a ``Constraint`` (``kestrel.skills.base``)."""

    __slots__ = ("matcher", "width")
    _executor: Any = None  # llguidance's thread pool for many rows, made on first use

    def __init__(self, matcher: Any, width: int) -> None:
        self.matcher, self.width = matcher, width

    def fill(self, mask_W: Any) -> None:
        self.matcher.unsafe_compute_mask_ptr(mask_W.data_ptr(), self.width * 4)

    @classmethod
    def fill_rows(cls, rows: Sequence[tuple[RowGrammar, int]], host: Any) -> None:
        """Many rows' masks at once into ``host`` (int32 [B, W], contiguous) on llguidance's
        threads; ``rows``: (grammar, row index)."""
        if len(rows) < 4:
            for g, b in rows:
                g.fill(host[b])
            return
        if cls._executor is None:
            cls._executor = _llguidance().LLExecutor()
        width = rows[0][0].width
        pairs = [(g.matcher, b) for g, b in rows]
        cls._executor.unsafe_compute_mask_ptr(pairs, host.data_ptr(), width * 4, host.shape[0])

    def accept(self, token_id: int) -> None:
        m = self.matcher
        if not m.consume_token(token_id) or m.is_error():
            raise GrammarError(f"token {token_id} is not allowed by the grammar: {m.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar can end here (an answer may stop)."""
        return self.matcher.is_accepting()


class Grammars:
    """Compiled grammars for one tokenizer (module doc). ``tokenizer_json``: a callable giving
    the ``tokenizer.json`` text; ``vocab_size``: the model's logits width; ``eos_id``: the
    token that ends an answer (allowed where the grammar may end)."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_id: int,
        max_bytes: int = CACHED_GRAMMAR_BYTES,
    ) -> None:
        self._json, self.vocab_size, self.eos_id = tokenizer_json, vocab_size, eos_id
        self.width = (vocab_size + 31) // 32
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key: (matcher, bytes)
        self.max_bytes, self.cached_bytes = max_bytes, 0
        self._lock = threading.Lock()
        self.compiles = 0  # specs compiled (cache misses)
        self.compile_ms = 0.0

    def tokenizer(self) -> Any:
        """llguidance's tokenizer, built once (under the lock)."""
        with self._lock:
            if self._tokenizer is None:
                lib = _llguidance()
                self._tokenizer = lib.LLTokenizer(
                    self._json(), n_vocab=self.vocab_size, eos_token=self.eos_id
                )
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Any:
        """The pristine matcher of ``spec`` (cached); InvalidInputError if it cannot compile."""
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
                return found[0]
        tok = self.tokenizer()
        lib = _llguidance()
        t0 = time.perf_counter()
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise InvalidInputError(f"response_format: {exc}") from None
        error = lib.LLMatcher.validate_grammar(text, tok)
        if error:
            what = {"regex": "regex", "choice": "choices"}.get(spec.kind, "JSON schema")
            raise InvalidInputError(f"response_format: the {what} cannot be compiled: {error}")
        matcher = lib.LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise InvalidInputError(f"response_format: {matcher.get_error()}")
        with self._lock:
            self.compiles += 1
            self.compile_ms += (time.perf_counter() - t0) * 1e3
            self._keep(spec.key, matcher, len(text.encode()))
        return matcher

    def _keep(self, key: str, matcher: Any, size: int) -> None:
        """Cache ``matcher`` (``size`` bytes of grammar text), least recently used out first,
        within the count and the bytes (under the lock)."""
        if size > self.max_bytes or key in self._cache:
            return
        self._cache[key] = (matcher, size)
        self.cached_bytes += size
        while len(self._cache) > CACHED_GRAMMARS or self.cached_bytes > self.max_bytes:
            _, (_, gone) = self._cache.popitem(last=False)
            self.cached_bytes -= gone

    def row(self, spec: GrammarSpec) -> RowGrammar:
        """A new request's grammar, at its start."""
        return RowGrammar(self.compile(spec).deep_copy(), self.width)

"""Constrained decoding's parts: response_format specs, llguidance grammars over a real
tokenizer (the embedded model's), the bitmask's layout, and a batch's choice under masks."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel.errors import InvalidInputError
from kestrel.grammar import Grammars, GrammarSpec, parse_response_format
from kestrel.moondream.sampling import allowed_tokens, mask_tokens
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.runtime.heads import choose
from kestrel.skills.base import Draw
from kestrel.tiny import MODEL_DIR

pytest.importorskip(
    "llguidance", reason='needs the structured extra: pip install "kestrel[structured]"'
)


INTEGER = {"type": "integer"}


@pytest.fixture(scope="module")
def tok() -> MoondreamTokenizer:
    return MoondreamTokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok.to_json, tok.vocab_size, 0)


def _allowed(grammar, vocab: int) -> set[int]:
    mask = torch.full((1, (vocab + 31) // 32), 0, dtype=torch.int32)
    grammar.fill(mask[0])
    return set(torch.nonzero(allowed_tokens(mask, vocab)[0]).flatten().tolist())


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ({"type": "json_object"}, "json_object"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True},
            },
            "json_schema",
        ),
        ({"type": "regex", "regex": "[ab]+"}, "regex"),
        ({"type": "choice", "choices": ["yes", "no"]}, "choice"),
    ],
)
def test_specs(value, kind) -> None:
    spec = parse_response_format(value)
    assert spec is not None and spec.kind == kind
    assert parse_response_format({"type": "text"}) is None and parse_response_format(None) is None


@pytest.mark.parametrize(
    "value",
    [
        "json",
        {"type": "yaml"},
        {"type": "json_object", "schema": {}},
        {"type": "json_schema", "json_schema": {"schema": []}},
        {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}},
        {"type": "regex", "regex": ""},
        {"type": "choice", "choices": []},
        {"type": "choice", "choices": ["a", 2]},
    ],
)
def test_bad_specs_are_invalid_input(value) -> None:
    with pytest.raises(InvalidInputError, match="response_format"):
        parse_response_format(value)


def test_keys_and_parse() -> None:
    def spec(schema):
        return parse_response_format({"type": "json_schema", "json_schema": {"schema": schema}})

    a, b = spec({"b": 1, "a": 2}), spec({"b": 1, "a": 2})
    assert a == b and a.key == b.key
    assert spec({"a": 2, "b": 1}).key != a.key  # the order of properties is the answer's
    assert a.parse('{"x": [1, 2]}') == {"x": [1, 2]} and a.parse('{"x": ') is None
    assert GrammarSpec("regex", "a+").parse("aa") == "aa"


@pytest.mark.parametrize(
    "value",
    [
        {"type": "regex", "regex": "("},
        {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
        {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}},
        },
    ],
)
def test_a_grammar_that_cannot_compile_is_invalid_input(grammars, value) -> None:
    with pytest.raises(InvalidInputError, match="cannot be compiled"):
        grammars.row(parse_response_format(value))


def test_compiled_once_per_spec(grammars) -> None:
    spec = parse_response_format({"type": "choice", "choices": ["alpha", "beta"]})
    before = grammars.compiles
    rows = [grammars.row(spec) for _ in range(3)]
    assert grammars.compiles == before + 1
    assert len({id(r.matcher) for r in rows}) == 3  # each request its own place in it


def test_mask_follows_the_grammar_token_by_token(grammars, tok) -> None:
    """A choice's allowed ids: the bitmask read on the device side (``allowed_tokens``) is
    exactly llguidance's set; the end token only once the grammar is complete; no special
    token ever inside the text."""
    spec = parse_response_format({"type": "choice", "choices": [" red circle", " blue"]})
    row = grammars.row(spec)
    vocab = tok.vocab_size
    for t in tok.encode(" red circle"):
        allowed = _allowed(row, vocab)
        assert t in allowed and 0 not in allowed
        assert not allowed & set(range(1, 10))  # the md_* control tokens
        row.accept(t)
    assert _allowed(row, vocab) == {0} and row.done
    with pytest.raises(RuntimeError, match="not allowed"):
        row.accept(tok.encode(" blue")[0])


def test_bit_layout_and_padding() -> None:
    mask = torch.tensor([[0b101, -(2**31)], [-1, 0]], dtype=torch.int32)
    allowed = allowed_tokens(mask, 70)  # wider than 64: the rest is not allowed
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 2, 63]
    assert torch.nonzero(allowed[1]).flatten().tolist() == list(range(32))
    logits = torch.zeros(2, 70)
    out = mask_tokens(logits, mask)
    assert torch.isinf(out).sum() == 2 * 70 - 3 - 32


class Allow:
    """A constraint that allows a fixed set of ids."""

    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def fill(self, mask_W) -> None:
        mask_W.zero_()
        for i in self.ids:
            mask_W[i // 32] |= torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)

    def accept(self, token_id: int) -> None:
        assert token_id in self.ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_choose_keeps_constrained_rows_inside_their_mask_and_free_rows_unchanged(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=gen) * 4
    allowed = [3, 40, 77]
    free = [Draw(temperature, 1.0, (), 0.3 + 0.1 * b) for b in range(6)]
    mixed = [d._replace(constraint=Allow(allowed)) if b % 2 else d for b, d in enumerate(free)]
    plain = choose(logits, free, special=False).picks
    picks = choose(logits, mixed).picks
    assert [p for b, p in enumerate(picks) if b % 2 == 0] == plain[0::2]
    assert all(p in allowed for p in picks[1::2])
    if temperature == 0:
        want = [allowed[int(logits[b, allowed].argmax())] for b in range(1, 6, 2)]
        assert picks[1::2] == want


def test_logprobs_with_the_choice() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    rows = choose(logits, [Draw(0.0, 1.0, logprobs=2), Draw(0.0, 1.0)]).rows()
    lp = torch.log_softmax(logits, dim=-1)
    chosen, top = rows[0].logprobs
    assert rows[0].chosen == 0 and abs(chosen - float(lp[0, 0])) <= 1e-6
    assert [i for i, _ in top] == [0, 1]
    assert all(abs(v - float(lp[0, i])) <= 1e-6 for i, v in top)
    assert rows[1].logprobs is None
    assert json.dumps(top)  # plain floats and ints


def test_the_cpu_and_device_bit_readings_agree() -> None:
    """The CPU's one-pass unpacking and the devices' shifts read the same bits, every word's
    sign bit included."""
    from kestrel.moondream.sampling import _shifted_bits, _unpacked_bits

    g = torch.Generator().manual_seed(5)
    mask = torch.randint(-(2**31), 2**31 - 1, (7, 50), dtype=torch.int32, generator=g)
    mask[0, 0], mask[1, 3] = -1, -(2**31)
    assert torch.equal(_unpacked_bits(mask).to(torch.int32), _shifted_bits(mask))
    assert _unpacked_bits(mask).sum() > 0


def test_the_cache_is_bounded_in_bytes_of_grammar(tok) -> None:
    """Past ``max_bytes`` of grammar text the least recently used grammars leave the cache
    (its bytes counted back); one larger than the whole budget is compiled but not kept."""
    from kestrel.grammar.compiler import grammar_text

    specs = [parse_response_format({"type": "choice", "choices": [f"word{i}"]}) for i in range(6)]
    size = len(grammar_text(specs[0]).encode())
    small = Grammars(tok.to_json, tok.vocab_size, 0, max_bytes=3 * size + size // 2)
    for spec in specs:
        small.row(spec)
    assert len(small._cache) == 3 and small.cached_bytes <= small.max_bytes
    assert small.cached_bytes == sum(n for _, n in small._cache.values())
    assert list(small._cache) == [s.key for s in specs[3:]]  # the oldest went first
    small.row(specs[5])
    assert small.compiles == 6  # a hit: nothing compiled again
    huge = parse_response_format({"type": "choice", "choices": ["x" * (4 * size)]})
    small.row(huge)
    assert huge.key not in small._cache and small.compiles == 7

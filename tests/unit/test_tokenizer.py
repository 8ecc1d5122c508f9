from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from kestrel.moondream.hub import CheckpointError
from kestrel.moondream.tokenizer import MoondreamTokenizer, StreamDecoder, TokenizerError


def fixture_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "fixtures" / "md2-tiny-a"
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", default))


@pytest.fixture(scope="module")
def tok() -> MoondreamTokenizer:
    return MoondreamTokenizer.from_dir(fixture_dir())


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((fixture_dir() / "golden.json").read_text())


def stream(tok: MoondreamTokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_loaders_agree(tok: MoondreamTokenizer, golden: dict) -> None:
    assert tok.vocab_size == golden["tokenizer"]["vocab_size"] == 1024
    by_file = MoondreamTokenizer.from_file(fixture_dir() / "tokenizer.json")
    by_name = MoondreamTokenizer.from_pretrained(str(fixture_dir()))
    for other in (by_file, by_name):
        assert other.encode("a red car") == tok.encode("a red car")
    for i, name in enumerate(golden["tokenizer"]["special_tokens"]):
        assert tok.token_to_id(name) == i


def test_prompt_ids_match_reference(tok: MoondreamTokenizer, golden: dict) -> None:
    raw = Tokenizer.from_file(str(fixture_dir() / "tokenizer.json"))
    checked = 0
    for case in golden["cases"]:
        parts = case["prompt_parts"]
        if "question" in parts:
            assert tok.encode(case["question"]) == parts["question"], case["id"]
            assert tok.encode(case["question"]) == raw.encode(case["question"]).ids
            checked += 1
        if "object" in parts:  # point/detect tokenize " " + object
            assert tok.encode(" " + case["object"]) == parts["object"], case["id"]
            checked += 1
    assert checked >= 10


def test_decode_and_stream_match_reference_text(tok: MoondreamTokenizer, golden: dict) -> None:
    texts = [c for c in golden["cases"] if c["kind"] in ("query", "caption")]
    assert texts
    for case in texts:
        assert tok.decode(case["greedy_ids"]) == case["text"], case["id"]
        assert "".join(stream(tok, case["greedy_ids"])) == case["text"], case["id"]


def test_encode_never_adds_specials(tmp_path: Path, tok: MoondreamTokenizer) -> None:
    raw = Tokenizer.from_file(str(fixture_dir() / "tokenizer.json"))
    assert raw.encode("hello").ids == tok.encode("hello")  # fixture: post-processor adds nothing
    raw.post_processor = TemplateProcessing(
        single="<|endoftext|> $A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)]
    )
    raw.save(str(tmp_path / "tokenizer.json"))
    with_bos = MoondreamTokenizer.from_dir(tmp_path)
    assert raw.encode("hello").ids[0] == 0  # the raw tokenizer would add BOS/EOS ...
    assert with_bos.encode("hello") == tok.encode("hello")  # ... ours does not


def test_decode_skips_specials_by_default(tok: MoondreamTokenizer) -> None:
    assert tok.decode([1, 455, 2]) == tok.decode([455])
    assert tok.decode([1, 455, 2], skip_special_tokens=False).startswith("<|md_open|>")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5, 1024])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_multibyte_chars_are_held_back(tok: MoondreamTokenizer) -> None:
    text = "Hi 😀 漢字!"
    ids = tok.encode(text)
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1  # the emoji spans several byte tokens in this vocab
    assert all("\ufffd" in tok.decode([i]) for i in emoji_ids)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "😀" in pieces  # emitted whole, once its last byte arrived
    dec = StreamDecoder(tok)
    assert [dec.push(i) for i in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert dec.push(emoji_ids[-1]) == "😀"


def test_flush_releases_incomplete_tail(tok: MoondreamTokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # cut inside the emoji
    dec = tok.stream_decoder()
    out = "".join(dec.push(i) for i in ids)
    assert out == "ok "
    tail = dec.flush()
    assert tail.endswith("\ufffd") and out + tail == tok.decode(ids)
    assert dec.flush() == ""
    with pytest.raises(TokenizerError, match="outside"):
        dec.push(tok.vocab_size)
    assert dec.push(tok.encode("x")[0]) == "x"  # the bad id did not poison the stream


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1023), max_size=40))
def test_stream_equals_decode_for_any_ids(tok: MoondreamTokenizer, ids: list[int]) -> None:
    dec = StreamDecoder(tok)
    pushed = [dec.push(i) for i in ids]
    assert not any(p.endswith("\ufffd") for p in pushed)
    assert "".join(pushed) + dec.flush() == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30))
def test_stream_round_trips_text(tok: MoondreamTokenizer, text: str) -> None:
    pieces = stream(tok, tok.encode(text))
    assert "".join(pieces) == tok.decode(tok.encode(text)) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_for_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tok = MoondreamTokenizer.for_checkpoint(fixture_dir() / "model.safetensors")
    assert tok.encode(" square") == [356]
    # No tokenizer.json beside the checkpoint: the fallback (a local one here) is used.
    fallback = str(fixture_dir() / "tokenizer.json")
    assert MoondreamTokenizer.for_checkpoint(tmp_path, fallback).encode(" square") == [356]
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="moondream/starmie-v1"):
        MoondreamTokenizer.for_checkpoint(tmp_path)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        MoondreamTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        MoondreamTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        MoondreamTokenizer.from_pretrained(str(tmp_path / "nope" / "deeper"))


def test_from_pretrained_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*pass that directory's path"):
        MoondreamTokenizer.from_pretrained("kestrel-test/no-such-tokenizer")


def test_from_pretrained_without_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"pip install 'kestrel\[hub\]'"):
        MoondreamTokenizer.from_pretrained()

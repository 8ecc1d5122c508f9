"""scripts/bench_structured.py --smoke: the figures it reports hold what the run did."""

from __future__ import annotations

import importlib

import pytest

from tests.scripts import on_path

pytest.importorskip("llguidance", reason="needs the structured extra (llguidance)")


def test_smoke_reports_every_row(capsys) -> None:
    with on_path():
        bench = importlib.import_module("bench_structured")
    out = bench.main(["--smoke"])
    assert [r["constrained"] for r in out["decode"]] == [0, 2, 4]
    assert all(r["steps"] > 0 and r["step_ms"]["median"] > 0 for r in out["decode"])
    assert all(r["step_ms"]["min"] <= r["step_ms"]["median"] <= r["step_ms"]["max"]
               for r in out["decode"])  # fmt: skip
    masks = [r["mask_host_us"]["median"] for r in out["decode"]]
    assert masks[0] == 0 and masks[2] > 0
    assert out["fill"]["tokens"] > 10 and out["fill"]["serial_us_per_row"] > 0
    c = out["compile"]
    assert c["vocab"] == 430 and c["cold_ms"] >= 0 and c["cached_ms"] >= 0
    assert "| constrained rows |" in capsys.readouterr().out


def test_gpt2_vocabulary_from_ranks(tmp_path) -> None:
    """BPE ranks in tiktoken's format become a tokenizer.json whose merges rebuild every
    ranked token, laid out after the fixture's special ids and padded to the vocabulary."""
    import base64

    from tokenizers import Tokenizer

    with on_path():
        models = importlib.import_module("bench_gpu_models")
    words = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b" wo"]
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(w).decode()} {r}\n" for r, w in enumerate(words)))
    models.gpt2_tokenizer(ranks, tmp_path / "tokenizer.json", 300)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("hello wo").ids
    assert ids == [10 + words.index(b"hello"), 10 + words.index(b" wo")]
    assert tok.decode(ids) == "hello wo" and tok.get_vocab_size() == 300
    assert tok.token_to_id("<|endoftext|>") == 0

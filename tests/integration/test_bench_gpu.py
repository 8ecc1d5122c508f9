"""scripts/bench_gpu.py on the CPU, small: its workload has ChartQA's shape, its closed loop
serves every request, and its random-weight checkpoint (here narrow, with a vocabulary wider
than the fixture tokenizer's, as Moondream 2's is) loads in the Engine and decodes any id."""

from __future__ import annotations

import importlib
import json
import weakref

import pytest
import torch

from kestrel import Engine
from tests.scripts import on_path

SMALL = {  # a narrow model of Moondream 2's structure, vocabulary past the fixture's 1024 ids
    "text": {"dim": 64, "ff_dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
             "vocab_size": 2048},
    "vision": {"enc_dim": 32, "enc_ff_dim": 64, "enc_n_layers": 1, "enc_n_heads": 2,
               "proj_out_dim": 64, "proj_inner_dim": 128, "crop_size": 56, "max_crops": 2,
               "overlap_margin": 1},
    "region": {"dim": 64, "inner_dim": 128},
}  # fmt: skip


@pytest.fixture(scope="module")
def bench_gpu():
    with on_path():
        yield importlib.import_module("bench_gpu")


def test_chartqa_workload_through_the_engine(bench_gpu, tmp_path) -> None:
    ckpt = bench_gpu.models.random_md2_checkpoint(tmp_path / "md2", SMALL)
    with Engine(ckpt, device="cpu", dtype="float32", max_batch_size=4) as engine:
        assert engine.runtime.tokenizer.vocab_size == 2048
        encode = engine.runtime.tokenizer.encode
        n_tokens = lambda text: len(encode(text))  # noqa: E731
        queries = bench_gpu.chart_workload(10, n_tokens, seed=3)
        assert len(queries) == 10 and len({q.image for q in queries}) == 6  # 10 / 1.66
        assert all(12 <= n_tokens(q.question) <= 20 for q in queries)
        for cot in (False, True):
            settings = {**bench_gpu.SAMPLING["default"], "max_tokens": 3}
            out = bench_gpu.measure(engine, queries[:6], 4, settings, cot)
            most = 3 * (2 if cot else 1)  # reasoning thinks up to max_tokens, then answers
            assert out["rps"] > 0 and out["p50_ms"] > 0 and 1 <= out["tokens"] <= most
            assert set(bench_gpu.PARTS) <= set(out)
            if not cot:  # new charts: a miss's time to first token, split (then all hits)
                assert 0 < out["prefill_miss_ms"] <= out["ttft_miss_ms"]
                assert 0 <= out["queue_miss_ms"] <= out["ttft_miss_ms"]
                assert out["submit_new_ms"] > 0 and out["submit_again_ms"] > 0  # 6 charts, 10 q
        stats = engine.stats()
        assert stats.requests_served == 12 and stats.requests_failed == 0
        engine.check_integrity()


def test_smoke_run_prints_the_table_and_the_published_figures(bench_gpu, capsys) -> None:
    bench_gpu.main(["--smoke", "--allow-busy", "--rounds", "1", "--batches", "1,2",
                    "--requests", "2", "--sampling", "greedy", "--summary"])  # fmt: skip
    out = capsys.readouterr().out
    for row in ("direct, greedy, batch 1", "direct, greedy, batch 2", "cot, greedy, batch 2"):
        assert f"| {row} |" in out
    assert "| direct, greedy, batch 1 | " in out and "| 41.9 | 11.7 |" in out
    assert "| md2 cot30, greedy, batch 1 | " in out and "| 16.2 | - |" in out  # a default mode
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["failed_requests"] == 0 and summary["crops_on_device"] is False  # a CPU


def test_md3_smoke_serves_a_random_moondream3_made_in_memory(bench_gpu, capsys) -> None:
    """``--family md3``: the Engine's loader makes the weights (FP8 experts) instead of reading
    a checkpoint; the ~30-token CoT row and Kestrel's Moondream 3 figures beside it."""
    bench_gpu.main(["--smoke", "--family", "md3", "--allow-busy", "--rounds", "1",
                    "--batches", "1", "--requests", "2", "--sampling", "greedy",
                    "--modes", "direct,cot30", "--startup-threads", "0", "--summary"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| md3 direct, greedy, batch 1 | " in out and "| 34.62 | - |" in out
    assert "| md3 cot30, greedy, batch 1 | " in out and "| 13.53 | - |" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["family"] == "md3" and summary["failed_requests"] == 0
    assert set(summary["req_s"]) == {"direct, greedy, batch 1", "cot30, greedy, batch 1"}
    cot30 = next(line for line in out.splitlines() if "| cot30, greedy, batch 1 |" in line)
    assert "| 28.0 (" in cot30  # 14 thinking + 14 answer: random weights never stop early


def test_both_families_one_engine_after_the_other(bench_gpu, capsys, monkeypatch, tmp_path):
    """``--family both``: Moondream 2, then Moondream 3 with FP8 experts, the first engine
    collected before the second is built (its KV pool is sized from the free memory); one
    ``--requests`` count per batch; one summary line, Moondream 3's under ``md3``."""
    built, sizes = [], []

    class Recording(bench_gpu.Engine):
        def __init__(self, *args, **kwargs) -> None:
            alive = [ref() is not None for ref, _ in built]
            super().__init__(*args, **kwargs)
            dtypes = {t.dtype for t in self.runtime.model.state_dict().values()}
            built.append((weakref.ref(self), (alive, torch.float8_e4m3fn in dtypes)))

    def measure(engine, queries, batch, settings, cot):
        sizes.append((batch, len(queries), settings["max_tokens"]))
        return real(engine, queries, batch, settings, cot)

    real = bench_gpu.measure
    monkeypatch.setattr(bench_gpu, "Engine", Recording)
    monkeypatch.setattr(bench_gpu, "measure", measure)
    bench_gpu.main(["--smoke", "--family", "both", "--allow-busy", "--rounds", "1",
                    "--batches", "1,2", "--requests", "1,3", "--sampling", "greedy",
                    "--modes", "direct", "--startup-threads", "0", "--summary",
                    "--md3-dir", str(tmp_path / "md3")])  # fmt: skip
    assert [info for _, info in built] == [([], False), ([False], True)]
    assert [s for s in sizes if s[2] == 4] == [(1, 1, 4), (2, 3, 4)] * 2  # each family's rows
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "md2" and summary["md3"]["family"] == "md3"
    for line in (summary, summary["md3"]):
        assert set(line["req_s"]) == {"direct, greedy, batch 1", "direct, greedy, batch 2"}
        assert line["failed_requests"] == 0 and line["failed_captures"] == 0

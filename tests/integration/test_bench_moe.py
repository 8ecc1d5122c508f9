"""``scripts/bench_moe.py``'s accounting on a tiny Moondream-3-shaped checkpoint: the random
checkpoint loads as Moondream 3, one decode row touches exactly top-k experts per MoE layer
(the active-parameter floor), and the dense equivalent does the MoE layers' MLP FLOPs."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel.moondream import MoondreamModel
from kestrel.runtime.runtime import MoondreamRuntime
from tests.scripts import on_path

TINY = argparse.Namespace(dim=64, heads=2, layers=3, moe_start=1, experts=8, top_k=2,
                          expert_inner=32, vocab=768, vision_dim=32, vision_layers=2,
                          steps=3)  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    with on_path():
        yield importlib.import_module("bench_moe")


def test_configs_and_flops(bench) -> None:
    md3, dense = bench.configs(TINY)
    assert (md3.family, dense.family) == ("moondream3", "moondream2")
    assert dense.text.ff_dim * 2 == 3 * TINY.top_k * TINY.expert_inner  # equal MLP FLOPs
    t, n = md3.text, 10
    no_moe = argparse.Namespace(**{**vars(TINY), "moe_start": TINY.layers})
    dense_only = bench.configs(no_moe)[0]
    router_and_experts = 2 * t.dim * TINY.experts + TINY.top_k * 6 * t.dim * TINY.expert_inner
    moe_layers = TINY.layers - TINY.moe_start
    want = moe_layers * n * (router_and_experts - 4 * t.dim * t.ff_dim)
    assert bench.prefill_flops(md3, n) - bench.prefill_flops(dense_only, n) == want
    with pytest.raises(SystemExit, match="--vocab"):
        bench.configs(argparse.Namespace(**{**vars(TINY), "vocab": 100}))


def test_decode_accounting(bench, tmp_path: Path) -> None:
    md3, _ = bench.configs(TINY)
    path = bench.write_model(tmp_path / "moe", md3, torch.float32)
    model = MoondreamModel.from_pretrained(path)
    assert model.config == md3  # the random checkpoint round-trips its MoE section
    rt = MoondreamRuntime.from_pretrained(path, max_batch_size=4, kv_cache_pages=4000)
    log = bench.ExpertLog()
    try:
        images = [np.full((378, 378, 3), 40 * i, dtype=np.uint8) for i in range(4)]
        one = bench.decode_variant(rt, log, images, 1, TINY)
        assert one["experts"] == TINY.top_k and one["floor"] == pytest.approx(1.0)
        four = bench.decode_variant(rt, log, images, 4, TINY)
        assert TINY.top_k <= four["experts"] <= TINY.experts
        assert four["floor"] >= 1.0 and four["tps"] > 0
    finally:
        log.restore()
    import kestrel.moondream.text as text_module
    from kestrel.moondream.moe import moe_mlp

    assert text_module.moe_mlp is moe_mlp


def test_forms_table_runs_every_form_and_checks_them_equal(capsys) -> None:
    """``bench_moe_forms.py`` at toy widths: every old form agrees with the grouped one (the
    script asserts it before timing) and gets a row where the old code took it."""
    with on_path():
        forms = importlib.import_module("bench_moe_forms")
    forms.main(["--dim", "32", "--inner", "16", "--experts", "8", "--top-k", "2",
                "--rows", "1,8", "--rounds", "1", "--allow-busy"])  # fmt: skip
    out = capsys.readouterr().out
    # 1 row x top 2 < 8 experts: the old gather; 8 rows: the old all-experts form
    for name, tables in (("grouped", 2), ("host-grouped", 2), ("gather", 1), ("all-experts", 1)):
        assert out.count(f"| {name} |") == tables, out
    assert out.count("N = ") == 2

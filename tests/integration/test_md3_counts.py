"""What Moondream 3 asks of a GPU, counted on a CPU: ``scripts/count_kernels.py``'s rows
(``scripts/kernel_counts.py``) on a 3- and a 5-layer Moondream 3 with FP8 experts, taking the
branches a GPU takes (the ``fa`` backend's stand-in, the Triton kernels under the interpreter,
Hopper's FP8 grouped GEMM), on a one-crop image. A decode step makes no host synchronisation,
a hit and a miss prefill none but the read of their first token, and none a blocking upload;
an MoE layer costs the decode graph at most 18 launches (attention 5, tau 3, the experts 10),
whatever the batch; a prefill's host launches stay within ``count_kernels``' targets (hit
<= 30, miss <= 60) because it replays its graph."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("triton")

from tests.scripts import on_path


@pytest.fixture(scope="module")
def kc(monkeypatch_module):
    monkeypatch_module.setenv("TRITON_INTERPRET", "1")
    with on_path():
        module = importlib.import_module("kernel_counts")
    whole = module.picture  # one crop, not nine: the counts per forward do not depend on it
    monkeypatch_module.setattr(module, "picture", lambda seed, h=378, w=378: whole(seed, h, w))
    # the crops' device probe (four images through the interpreted kernel) is tested apart
    # (tests/unit/test_resample.py): trusted here
    monkeypatch_module.setattr(module, "_probe_once", lambda config, device: None)
    return module


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_md3_decode_never_syncs_and_an_moe_layer_is_18_launches(kc) -> None:
    with kc.gpu_branches():
        rows = {(layers, batch): kc.decode_rows(batch, kc.GREEDY, False, "md3", layers)
                for layers, batch in ((3, 1), (3, 4), (5, 1))}  # fmt: skip
    for r in rows.values():
        assert r["rows"] > 0 and r["syncs"] == 0 and r["uploads_blocking"] == 0, r
    # static shapes: the batch changes no launch
    assert rows[3, 1]["graph_body"] == rows[3, 4]["graph_body"]
    per_moe_layer = (rows[5, 1]["graph_body"] - rows[3, 1]["graph_body"]) / 2
    assert per_moe_layer <= 18, per_moe_layer


def test_md3_prefill_never_syncs_and_replays_its_graphs(kc) -> None:
    with kc.gpu_branches():
        pre = kc.prefill_rows("md3", layers=3)
    hit, miss = pre["prefill_hit"], pre["prefill_miss"]
    # the one read that ends a prefill (its first token, for the skill), nothing in it
    assert kc.forward_syncs(hit) == kc.forward_syncs(miss) == 0
    assert kc.readbacks(hit) == kc.readbacks(miss) == 1
    assert hit.uploads_blocking == miss.uploads_blocking == 0
    assert hit.replays >= 1 and miss.replays >= 1  # the graph bodies ran (uncaptured)
    assert kc.eager(hit) <= 30 and kc.eager(miss) <= 60

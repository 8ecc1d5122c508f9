"""Moondream 3 in the model package without the goldens: family detection, the legacy layout,
the FP8 refusal, the hub message, the grouped MoE against a per-token loop, and the prompts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.moondream.config import MOONDREAM3, MoondreamConfig, TextMoeConfig
from kestrel.moondream.layout import _legacy_name
from kestrel.moondream.model import Linear, MoeWeights, MoondreamModel
from kestrel.moondream.moe import expert_activation, moe_mlp
from kestrel.moondream.weights import (
    CheckpointError,
    detect_family,
    load_config,
    load_state_dict,
    resolve_checkpoint,
)
from kestrel.skills.prompts import query_prompt, token_ids
from kestrel.skills.settings import DEFAULT_SETTINGS, family_settings, parse_settings
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

MD3 = FIXTURES / "md3-tiny-a"
MD2 = FIXTURES / "md2-tiny-a"


def test_family_from_config_and_keys(tmp_path: Path) -> None:
    assert load_config(MD3).family == MOONDREAM3 and load_config(MD2).family == "moondream2"
    assert detect_family(MD3) == MOONDREAM3 and detect_family(MD2) == "moondream2"
    # production config.json files carry "config": {}: the tensors decide, defaults follow
    (tmp_path / "model.safetensors").symlink_to((MD3 / "model.safetensors").resolve())
    (tmp_path / "config.json").write_text(json.dumps({"config": {}}))
    cfg = load_config(tmp_path)
    assert cfg.family == MOONDREAM3 and cfg.text.moe == TextMoeConfig()
    assert (cfg.text.rope_theta, cfg.text.max_context, cfg.region.inner_dim) == (1.5e6, 4096, None)
    assert not cfg.tokenizer.query_doubled_answer and cfg.tokenizer.continue_on_coord
    assert MoondreamConfig().text.rope_theta == 10000.0  # Moondream 2 keeps its own


def test_legacy_names() -> None:
    cfg = load_config(MD3)
    h = "text_model.transformer.h"
    assert _legacy_name("text.blocks.1.mlp.fc1.weight", cfg) == f"{h}.1.mlp.experts.weight"
    assert _legacy_name("text.blocks.2.mlp.fc2.weight", cfg) == f"{h}.2.mlp.output_experts.weight"
    assert _legacy_name("text.blocks.0.mlp.fc1.weight", cfg) == f"{h}.0.mlp.fc1.weight"
    assert _legacy_name("text.blocks.1.mlp.router.bias", cfg) == f"{h}.1.gate.bias"
    assert _legacy_name("text.blocks.0.attn.tau.alpha", cfg) == f"{h}.0.tau_alpha"
    assert _legacy_name("region.coord_decoder.weight", cfg) == "region_model.coordinate_head.weight"
    assert _legacy_name("region.size_decoder.bias", cfg) == "region_model.size_head.bias"


def test_legacy_layout_loads_the_same(tmp_path: Path) -> None:
    cfg = load_config(MD3)
    native = load_state_dict(MD3, cfg)
    legacy = {}
    for name, t in native.items():
        t = t.T.contiguous() if name.endswith("_features") else t
        legacy[_legacy_name(name, cfg).replace(".h.0.", ".h.0._orig_mod.")] = t
    save_file(legacy, str(tmp_path / "model.safetensors"))
    shutil.copy(MD3 / "config.json", tmp_path / "config.json")
    loaded = load_state_dict(tmp_path, cfg)
    assert loaded.keys() == native.keys()
    assert all(torch.equal(loaded[k], native[k]) for k in native)


def test_fp8_markers_in_a_native_file_and_an_empty_pt_are_refused(tmp_path: Path) -> None:
    """FP8 files load now (tests/unit/test_fp8_loading.py); a native file with a legacy scale
    key mixes layouts, and an empty model_fp8.pt is not a tensor dict."""
    sd = load_file(str(MD3 / "model.safetensors"))
    sd["text_model.transformer.h.1.moe_quant.up_scale"] = torch.ones(1)
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(MD3 / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="mixes the native layout") as err:
        MoondreamModel.from_pretrained(tmp_path)
    assert "moe_quant.up_scale" in str(err.value)
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "model_fp8.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model_fp8\.pt as a torch tensor dict"):
        load_state_dict(pt, load_config(MD3))


@pytest.mark.parametrize("repo", ["moondream/moondream3-preview", "moondream/moondream3.1-9B-A2B"])
def test_hub_ids_offline(repo: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="pass that directory's path") as err:
        resolve_checkpoint(repo)
    assert repo in str(err.value)


def _random_moe(e: int, inner: int, dim: int, gen: torch.Generator) -> MoeWeights:
    return MoeWeights(
        router=Linear(torch.randn(e, dim, generator=gen), torch.randn(e, generator=gen)),
        up=torch.randn(e, 2 * inner, dim, generator=gen) / dim**0.5,
        down=torch.randn(e, dim, inner, generator=gen) / inner**0.5,
    )


def test_grouped_moe_equals_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    cfg = TextMoeConfig(num_experts=8, start_layer=0, experts_per_token=3, expert_inner_dim=16)
    w = _random_moe(8, 16, 32, gen)
    x = torch.randn(2, 5, 32, generator=gen, dtype=torch.float64).float()
    out, routing = moe_mlp(x, w, cfg)
    want = torch.zeros(10, 32)
    for n, xn in enumerate(x.reshape(10, 32)):
        for e, wk in zip(routing.experts[n].tolist(), routing.weights[n], strict=True):
            h, g = (w.up[e] @ xn).chunk(2)
            want[n] += wk * (w.down[e] @ expert_activation(h, g))
    assert_close(out.reshape(10, 32), want, rel=1e-5)
    assert_close(routing.weights.sum(-1), torch.ones(10))


def test_moe_reads_only_the_chosen_experts() -> None:
    """Experts no token chose are never read: poisoning them changes nothing."""
    gen = torch.Generator().manual_seed(1)
    cfg = TextMoeConfig(num_experts=8, start_layer=0, experts_per_token=2, expert_inner_dim=16)
    w = _random_moe(8, 16, 32, gen)
    x = torch.randn(1, 1, 32, generator=gen)  # one decode row: 2 of 8 experts
    out, routing = moe_mlp(x, w, cfg)
    unused = sorted(set(range(8)) - set(routing.experts.flatten().tolist()))
    up, down = w.up.clone(), w.down.clone()
    up[unused], down[unused] = float("nan"), float("nan")
    poisoned, _ = moe_mlp(x, MoeWeights(w.router, up, down), cfg)
    assert torch.equal(out, poisoned)


def test_query_prompts_per_family() -> None:
    md2, md3 = load_config(MD2).tokenizer, load_config(MD3).tokenizer

    def ids(tok, reasoning: bool) -> list[int]:
        return token_ids(query_prompt(tok, lambda s: [100], "q", reasoning=reasoning), tok)

    assert ids(md2, False)[-3:] == [100, 3, 3] and ids(md2, True)[-3:] == [100, 3, 4]
    assert ids(md3, False)[-2:] == [100, 3] and ids(md3, True)[-2:] == [100, 4]


def test_family_settings() -> None:
    md3 = family_settings(load_config(MD3).family)
    assert (md3.temperature, md3.top_p, md3.max_tokens, md3.max_objects) == (0.5, 0.9, 768, 150)
    assert family_settings(load_config(MD2).family) == DEFAULT_SETTINGS
    s = parse_settings({"temperature": 0.0}, md3)
    assert (s.temperature, s.top_p, s.max_objects) == (0.0, 0.9, 150)
    assert parse_settings(None, md3) is md3

"""Unit tests of the model pieces: rope, region bins, sampling, LoRA loading, prompts, weights."""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.moondream.config import MoondreamConfig, RegionConfig
from kestrel.moondream.lora import LoraFormatError, load_adapter, normalize_lora_name
from kestrel.moondream.model import MissingWeightError, MoondreamModel
from kestrel.moondream.region import (
    SpatialRefError,
    coord_to_bin,
    coord_token,
    size_bin_to_value,
    size_to_bin,
    spatial_ref_tokens,
)
from kestrel.moondream.rope import apply_rope, rope_cos_sin
from kestrel.moondream.sampling import SamplingError, apply_top_p, sample, suppress
from kestrel.skills.prompts import (
    PromptError,
    caption_prompt,
    detect_prompt,
    point_prompt,
    query_prompt,
    token_ids,
)
from kestrel.tokens import CoordToken, SizeToken, TextToken
from tests.conftest import fixture_dir
from tests.tolerance import assert_close

FIX = fixture_dir()


@pytest.fixture(scope="module")
def cfg() -> MoondreamConfig:
    return MoondreamConfig.from_json_file(FIX / "config.json")


# ------------------------------------------------------------------------------------ rope
def test_rope_matches_direct_formula():
    torch.manual_seed(0)
    B, T, H, D, R = 2, 5, 3, 64, 32
    x = torch.randn(B, T, H, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 700], [5, 6, 7, 8, 2047]])
    cos, sin = rope_cos_sin(pos, R, 10000.0)
    out = apply_rope(x.float(), cos, sin).double()
    # float32 angles: p * w is rounded to ~2047 * 6e-8 rad at the last position, an error of
    # up to ~1.5e-4 of each row's magnitude (x ~ 3): 2e-4 of the scale
    rel = 2e-4
    for b in range(B):
        for t in range(T):
            for i in range(R // 2):
                ang = pos[b, t].item() * 10000.0 ** (-2 * i / R)
                a, c = x[b, t, :, i], x[b, t, :, i + R // 2]
                want = a * math.cos(ang) - c * math.sin(ang)
                assert_close(out[b, t, :, i], want, rel=rel, dtype=torch.float32)
                want = a * math.sin(ang) + c * math.cos(ang)
                assert_close(out[b, t, :, i + R // 2], want, rel=rel, dtype=torch.float32)
    # pass-through dims: copied, only rounded to float32 on the way in (x is float64)
    assert torch.equal(out[..., R:], x[..., R:].float().double())


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([[pq]]), 32, 10000.0)
        ck, sk = rope_cos_sin(torch.tensor([[pk]]), 32, 10000.0)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)


def test_rope_keeps_bf16_dtype():
    x = torch.randn(1, 2, 1, 64, dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.tensor([[0, 1]]), 32, 10000.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[:, 0], x[:, 0])  # position 0 is the identity rotation


# ------------------------------------------------------------------------------------ region bins
def test_size_bins_round_trip():
    rc = RegionConfig()
    for b in range(rc.size_bins):
        assert size_to_bin(size_bin_to_value(b, rc), rc) == b
    assert size_bin_to_value(rc.size_bins - 1, rc) == 1.0
    assert size_bin_to_value(0, rc) == 2.0**-10
    assert size_to_bin(0.0, rc) == 0 and size_to_bin(5.0, rc) == rc.size_bins - 1


def test_coord_bins_from_config():
    rc = RegionConfig(coord_out_dim=512)
    for b in range(rc.coord_bins):
        assert coord_to_bin(b / (rc.coord_bins - 1), rc) == b  # the training-label rule
    assert coord_to_bin(-0.2, rc) == 0 and coord_to_bin(1.5, rc) == rc.coord_bins - 1
    tok = coord_token(1023, RegionConfig())
    assert tok.pos == 1023 / 1024 and tok.bin == 1023  # fed back as bin / coord_bins


def test_spatial_ref_tokens_point_and_box():
    rc = RegionConfig()
    toks = spatial_ref_tokens([[0.25, 0.5], [0.1, 0.2, 0.6, 0.7]], rc)
    assert [type(t) for t in toks] == [CoordToken, CoordToken, CoordToken, CoordToken, SizeToken]
    assert toks[0].pos == 0.25 and toks[0].bin == round(0.25 * 1023)
    assert toks[2].pos == (0.1 + 0.6) / 2 and toks[3].pos == (0.2 + 0.7) / 2
    assert toks[4].width == 0.6 - 0.1 and toks[4].width_bin == size_to_bin(0.5, rc)
    for bad in ([0.1], [0.1, 2.0], [0.5, 0.5, 0.4, 0.6], ["a", "b"]):
        with pytest.raises(SpatialRefError):
            spatial_ref_tokens([bad], rc)


# ------------------------------------------------------------------------------------ sampling
def test_greedy_ties_pick_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert sample(logits, 0.0).tolist() == [1, 0]


def test_top_p_keeps_the_head_of_the_distribution():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    out = apply_top_p(probs, torch.tensor([0.6]))
    # 0.5 survives (nothing before it); 0.3 survives (0.5 before it is not > 0.6); rest dropped.
    assert_close(out, torch.tensor([[0.0, 0.625, 0.375, 0.0]]))
    tiny = apply_top_p(probs, torch.tensor([1e-6]))
    assert tiny.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # the top token always survives


def test_sampling_per_row_settings_and_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 5.0, 4.9], [0.0, 5.0, 4.9]]).repeat(200, 1)
    temps = [0.0, 1.0] * 200
    out = sample(logits, temps, 1.0, generator=g)
    assert (out[0::2] == 1).all()  # greedy rows
    hot = out[1::2]
    assert set(hot.tolist()) <= {0, 1, 2} and (hot == 2).any() and (hot == 1).any()
    narrow = sample(logits[:50], 1.0, 0.01, generator=g)  # top_p keeps only the top token
    assert (narrow == 1).all()
    with pytest.raises(SamplingError):
        sample(logits[:2], -1.0)
    with pytest.raises(SamplingError):
        sample(logits[:2], 1.0, 0.0)
    with pytest.raises(SamplingError):
        sample(logits[:2], [0.0, 0.0, 0.0])


def test_suppress_rows():
    logits = torch.zeros(2, 5)
    out = suppress(logits, [3, 0], rows=torch.tensor([True, False]))
    assert out[0, 3] == float("-inf") and out[0, 0] == float("-inf") and out[1].eq(0).all()
    assert logits.eq(0).all()  # input untouched


# ------------------------------------------------------------------------------------ lora
def test_lora_formats_load_equal(cfg):
    a = load_adapter(FIX / "adapter" / "final.pt", cfg, name="x")
    b = load_adapter(FIX / "adapter" / "adapter.safetensors", cfg, name="x")
    assert a.digest == b.digest and a.lora_id == b.lora_id == f"x@{a.digest[:16]}"
    assert a.rank == 4 and len(a.layers) == cfg.text.n_layers
    for la, lb in zip(a.layers, b.layers, strict=True):
        for m in ("qkv", "proj", "fc1", "fc2"):
            assert torch.equal(getattr(la, m).A, getattr(lb, m).A)
            assert torch.equal(getattr(la, m).B, getattr(lb, m).B)
    assert load_adapter(FIX / "adapter", cfg).name == "adapter"


def test_lora_name_normalization():
    key = "text_model.transformer.h.3.mixer.out_proj.parametrizations.weight.0.B"
    assert normalize_lora_name(key) == "text.blocks.3.attn.proj.B"


def _write(tmp_path, tensors):
    from safetensors.torch import save_file

    path = tmp_path / "adapter.safetensors"
    save_file(tensors, str(path))
    return path


def test_lora_errors(cfg, tmp_path):
    from safetensors.torch import load_file

    good = load_file(str(FIX / "adapter" / "adapter.safetensors"))
    missing = {k: v for k, v in good.items() if "blocks.1.mlp.fc2.B" not in k}
    with pytest.raises(LoraFormatError, match=r"lacks 1 tensor"):
        load_adapter(_write(tmp_path, missing), cfg)
    bad_shape = dict(good, **{"text.blocks.0.attn.qkv.B": torch.zeros(7, 4)})
    with pytest.raises(LoraFormatError, match=r"text.blocks.0.attn.qkv"):
        load_adapter(_write(tmp_path, bad_shape), cfg)
    unknown = dict(good, **{"vision.proj.A": torch.zeros(4, 4)})
    with pytest.raises(LoraFormatError, match="unknown key"):
        load_adapter(_write(tmp_path, unknown), cfg)
    extra_layer = dict(good, **{"text.blocks.9.mlp.fc1.A": torch.zeros(4, 128)})
    with pytest.raises(LoraFormatError, match=r"layer\(s\) \[9\]"):
        load_adapter(_write(tmp_path, extra_layer), cfg)
    with pytest.raises(FileNotFoundError):
        load_adapter(tmp_path / "nope", cfg)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(LoraFormatError):
        load_adapter(tmp_path / "junk.pt", cfg)


# ------------------------------------------------------------------------------------ prompts
def _enc(text: str) -> list[int]:
    return [100 + ord(c) % 50 for c in text]


def test_prompts(cfg):
    tok = cfg.tokenizer
    q = cfg.tokenizer.templates["query"]
    p = query_prompt(tok, _enc, "hi")
    assert token_ids(p, tok) == [tok.bos_id, *q["prefix"], *_enc("hi"), *q["suffix"], *q["suffix"]]
    spatial = spatial_ref_tokens([[0.1, 0.2]], cfg.region)
    p = query_prompt(tok, _enc, "hi", spatial=spatial, reasoning=True)
    assert token_ids(p, tok)[-2:] == [tok.answer_id, tok.thinking_id]
    assert p[1 + len(q["prefix"])] is spatial[0]
    assert token_ids(caption_prompt(tok, "short"), tok) == [
        tok.bos_id,
        *tok.templates["caption"]["short"],
    ]
    d = tok.templates["detect"]
    assert token_ids(detect_prompt(tok, _enc, "cat"), tok) == [
        tok.bos_id,
        *d["prefix"],
        *_enc(" cat"),
        *d["suffix"],
    ]
    pt = tok.templates["point"]
    assert token_ids(point_prompt(tok, _enc, "cat"), tok) == [
        tok.bos_id,
        *pt["prefix"],
        *_enc(" cat"),
        *pt["suffix"],
    ]
    assert all(isinstance(t, TextToken) for t in point_prompt(tok, _enc, "cat"))
    with pytest.raises(PromptError):
        caption_prompt(tok, "epic")
    with pytest.raises(PromptError):
        point_prompt(tok, _enc, "  ")


# ------------------------------------------------------------------------------------ weights
def test_model_from_state_dict_errors_and_counts(cfg):
    model = MoondreamModel.from_pretrained(FIX)
    counts = model.parameter_counts()
    assert counts["total"] == counts["vision"] + counts["text"] + counts["region"]
    sd = model.state_dict()
    assert counts["total"] == sum(t.numel() for t in sd.values())
    assert "text.blocks.0.attn.qkv.weight" in sd and "region.size_decoder.fc2.bias" in sd
    broken = dict(sd)
    del broken["text.blocks.1.mlp.fc2.bias"]
    with pytest.raises(MissingWeightError, match=r"text.blocks.1.mlp.fc2.bias"):
        MoondreamModel.from_state_dict(broken, cfg)
    broken = dict(sd, **{"text.wte": sd["text.wte"][:10]})
    with pytest.raises(MissingWeightError, match=r"text\.wte"):
        MoondreamModel.from_state_dict(broken, cfg)
    assert model.to(dtype=torch.bfloat16).dtype == torch.bfloat16


def _run_rows(model, x_BTC, lora):
    from kestrel.kv.page_table import PagedKVCache
    from kestrel.moondream.forward_inputs import ForwardInputs
    from kestrel.moondream.text import text_forward
    from kestrel_kernels.batch import AttentionBatch

    t = model.config.text
    B, T, _ = x_BTC.shape
    kv = PagedKVCache(
        n_pages=1 + B * T, n_layers=t.n_layers, n_kv_heads=t.n_kv_heads, head_dim=t.head_dim
    )
    pages = torch.arange(1, 1 + B * T).view(B, T)
    attention = AttentionBatch(
        positions_BT=torch.arange(T).expand(B, T),
        slot_mapping=pages.flatten(),
        page_table=pages.to(torch.int32),
        seqused_k=torch.full((B,), T, dtype=torch.int32),
    )
    return text_forward(x_BTC, model.text, t, ForwardInputs.of(attention, lora), kv)


def test_text_forward_per_row_lora(cfg):
    """Rows of one batch may use different adapters: each row equals its own single-row run."""
    model = MoondreamModel.from_pretrained(FIX)
    ad = load_adapter(FIX / "adapter", cfg)
    torch.manual_seed(0)
    x = torch.randn(3, 4, cfg.text.dim)
    with torch.inference_mode():
        mixed = _run_rows(model, x, [ad, None, ad])
        alone = [_run_rows(model, x[i : i + 1], a) for i, a in enumerate(([ad], None, [ad]))]
        base = _run_rows(model, x[1:2], [None])
    for i in range(3):
        assert_close(mixed[i], alone[i][0], rel=1e-05)
    assert_close(base, alone[1])
    assert (mixed[0] - _run_rows(model, x[:1], None)[0]).abs().max() > 1e-2  # the adapter acts

"""Adapters on Moondream 3 (md3-tiny-a: layer 0 dense, layers 1-2 MoE): attention pairs apply in
every layer and MLP pairs in the dense ones, exactly as weights merged into the checkpoint
would; the MoE layers' MLP pairs are ignored, as the first-party reference ignores them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from kestrel import Engine
from kestrel.moondream.lora import LORA_MODULES, LoraAdapter, LoraFormatError, load_adapter
from kestrel.moondream.weights import load_config
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

MD3 = FIXTURES / "md3-tiny-a"
CONFIG = load_config(MD3)
RANK = 4
IMAGE = MD3 / "images" / "shapes_378.png"
QUESTION = "What color is the circle?"


def _shapes(module: str) -> tuple[int, int]:
    t = CONFIG.text
    return {"attn.qkv": (t.dim, t.qkv_dim), "attn.proj": (t.dim, t.dim),
            "mlp.fc1": (t.dim, t.ff_dim), "mlp.fc2": (t.ff_dim, t.dim)}[module]  # fmt: skip


def random_adapter(seed: int, *, proj: bool = True, moe_mlp_seed: int | None = 0) -> dict:
    """Every layer's four pairs; MoE layers' MLP pairs drawn from ``moe_mlp_seed`` (None: left
    out), with shapes no MoE layer could use."""
    gen = torch.Generator().manual_seed(seed)
    moe_gen = torch.Generator().manual_seed(moe_mlp_seed or 0)
    out = {}
    for i in range(CONFIG.text.n_layers):
        for m in LORA_MODULES:
            n_in, n_out = _shapes(m)
            if CONFIG.text.is_moe_layer(i) and m.startswith("mlp"):
                if moe_mlp_seed is not None:
                    out[f"text.blocks.{i}.{m}.A"] = torch.randn(RANK, 7, generator=moe_gen)
                    out[f"text.blocks.{i}.{m}.B"] = torch.randn(5, RANK, generator=moe_gen)
                continue
            scale = 0.0 if (m == "attn.proj" and not proj) else 0.2
            out[f"text.blocks.{i}.{m}.A"] = torch.randn(RANK, n_in, generator=gen) * 0.2
            out[f"text.blocks.{i}.{m}.B"] = torch.randn(n_out, RANK, generator=gen) * scale
    return out


def test_load_adapter_shape_checks(tmp_path: Path) -> None:
    save_file(random_adapter(1), str(tmp_path / "adapter.safetensors"))
    adapter = load_adapter(tmp_path, CONFIG)
    assert adapter.rank == RANK and adapter.name == tmp_path.name
    dense, moe = adapter.layers[0], adapter.layers[CONFIG.text.moe.start_layer]
    assert dense.fc1 is not None and dense.fc2 is not None
    assert moe.fc1 is None and moe.fc2 is None and moe.qkv.A.shape == (RANK, CONFIG.text.dim)
    LoraAdapter.from_tensors("no-moe-mlp", random_adapter(1, moe_mlp_seed=None), CONFIG)
    lacking = random_adapter(1)
    del lacking["text.blocks.0.mlp.fc1.B"]
    with pytest.raises(LoraFormatError, match=r"lacks 1 .*mlp only below layer 1"):
        LoraAdapter.from_tensors("x", lacking, CONFIG)
    bad = random_adapter(1)
    bad["text.blocks.2.attn.qkv.B"] = torch.zeros(CONFIG.text.qkv_dim + 1, RANK)
    with pytest.raises(LoraFormatError, match=r"text\.blocks\.2\.attn\.qkv"):
        LoraAdapter.from_tensors("x", bad, CONFIG)
    no_moe_attn = random_adapter(1)
    del no_moe_attn["text.blocks.1.attn.proj.A"]
    with pytest.raises(LoraFormatError, match="lacks 1"):
        LoraAdapter.from_tensors("x", no_moe_attn, CONFIG)


def merged_checkpoint(out: Path, tensors: dict) -> Path:
    """md3-tiny-a with the adapter's qkv (every layer) and fc1 / fc2 (dense layers) pairs
    merged into the weights: W + B @ A (the proj pair reads the LN output: not mergeable)."""
    shutil.copytree(MD3, out, ignore=shutil.ignore_patterns("golden*", "images"))
    sd = load_file(str(MD3 / "model.safetensors"))
    for i in range(CONFIG.text.n_layers):
        modules = (
            ["attn.qkv"] if CONFIG.text.is_moe_layer(i) else ["attn.qkv", "mlp.fc1", "mlp.fc2"]
        )
        for m in modules:
            a, b = tensors[f"text.blocks.{i}.{m}.A"], tensors[f"text.blocks.{i}.{m}.B"]
            key = f"model.text.blocks.{i}.{m}.weight"
            sd[key] = (sd[key].double() + b.double() @ a.double()).float()
    save_file(sd, str(out / "model.safetensors"))
    return out


def _logits(rt: MoondreamRuntime, adapter: LoraAdapter | None) -> torch.Tensor:
    t = rt.config.tokenizer
    q = t.templates["query"]
    ids = [t.bos_id, *q["prefix"], *rt.tokenizer.encode(QUESTION), *q["suffix"]]
    with torch.inference_mode():  # text only (the Engine test below has the image)
        state, logits = rt.start_sequence([TextToken(i) for i in ids], None, adapter=adapter)
        rt.release_sequence(state)
    return logits


def test_md3_adapter_equals_merged_weights(tmp_path: Path) -> None:
    options = {"device": "cpu", "dtype": torch.float32, "kv_cache_pages": 3000}
    rt = MoondreamRuntime.from_pretrained(MD3, **options)
    tensors = random_adapter(2, proj=False)
    adapter = LoraAdapter.from_tensors("a", tensors, CONFIG)
    other_moe = LoraAdapter.from_tensors("b", random_adapter(2, proj=False, moe_mlp_seed=9), CONFIG)
    with_proj = LoraAdapter.from_tensors("c", random_adapter(2), CONFIG)
    base, got = _logits(rt, None), _logits(rt, adapter)
    assert (got - base).abs().max() > 1e-2  # the adapter does something
    assert torch.equal(_logits(rt, other_moe), got)  # MoE layers' MLP pairs are ignored
    assert (_logits(rt, with_proj) - got).abs().max() > 1e-3  # proj pairs apply
    merged = MoondreamRuntime.from_pretrained(merged_checkpoint(tmp_path / "m", tensors), **options)
    assert_close(got, _logits(merged, None), rel=0.0001)


def test_md3_adapter_through_the_engine(tmp_path: Path) -> None:
    tensors = random_adapter(3, proj=False)
    save_file(tensors, str(tmp_path / "adapter.safetensors"))
    merged = merged_checkpoint(tmp_path / "m", tensors)
    settings = {"temperature": 0.0, "max_tokens": 6}
    image = Image.open(IMAGE).convert("RGB")
    opts = {"device": "cpu", "dtype": "float32", "kv_cache_pages": 3000}
    with Engine(MD3, **opts) as e, Engine(merged, **opts) as m:
        e.load_adapter("md3-lora", tmp_path)
        want = m.query(image, QUESTION, settings=settings).tokens
        for _ in range(2):  # cold, then from the adapter's cache namespace
            got = e.query(image, QUESTION, settings=settings, adapter="md3-lora")
            assert got.tokens == want
        assert e.query(image, QUESTION, settings=settings).tokens != want

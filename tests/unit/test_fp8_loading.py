"""Moondream 3 in its published FP8 form: every on-disk form loads to the same tensors, the
in-memory forms (``moe_weights``), the refusal matrix (each message names the tensor), a ``.pt``
that is anything but a plain tensor dict, and the hub ids resolved against fake listings."""

from __future__ import annotations

import fnmatch
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kestrel.moondream.fp8 import FP8_DTYPE
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import decode_coordinate
from kestrel.moondream.text import layer_norm, linear
from kestrel.moondream.weights import CheckpointError, load_config, load_state_dict
from kestrel.testing.fp8_checkpoint import fp8_tensors, write_fp8_checkpoint
from tests.tolerance import assert_close
from tests.unit.test_weights import FakeHub

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MD3, MD3_FP8 = FIXTURES / "md3-tiny-a", FIXTURES / "md3-tiny-a-fp8"
CONFIG = load_config(MD3)
L = "text_model.transformer.h"


@pytest.fixture(scope="module")
def native() -> dict[str, torch.Tensor]:
    return load_state_dict(MD3, CONFIG)


@pytest.fixture(scope="module")
def published(native) -> dict[str, torch.Tensor]:
    """md3-tiny-a in the published form (legacy names, FP8 experts, row scales)."""
    return fp8_tensors(native, CONFIG)


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(MD3 / "config.json", tmp_path / "config.json")
    return tmp_path


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        x, y = a[k], b[k]
        if x.dtype == FP8_DTYPE:  # compare the bytes (float8 equality is not implemented)
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


def test_fixture_is_the_published_form(native) -> None:
    """md3-tiny-a-fp8 holds FP8 experts and float32 scales; its scales are absmax / 448 and
    its experts dequantise to md3-tiny-a's within e4m3's relative step (2^-4 of a row's max)."""
    sd = load_state_dict(MD3_FP8, CONFIG)
    for i in (1, 2):
        for fc in ("fc1", "fc2"):
            q, scale = sd[f"text.blocks.{i}.mlp.{fc}.weight"], sd[f"text.blocks.{i}.mlp.{fc}.scale"]
            w = native[f"text.blocks.{i}.mlp.{fc}.weight"]
            assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
            assert_close(scale, w.abs().amax(-1) / 448, rel=1e-06)
            err = (q.float() * scale[..., None] - w).abs()
            assert bool((err <= w.abs().amax(-1, keepdim=True) * 2.0**-4).all())
            assert float(err.max()) > 0  # really quantised
    assert sd.keys() - native.keys() == {
        f"text.blocks.{i}.mlp.{fc}.scale" for i in (1, 2) for fc in ("fc1", "fc2")
    }


@pytest.mark.parametrize("form", ["pt", "sharded", "fused_tau", "pt_fused_tau"])
def test_every_form_loads_the_same(form: str, tmp_path: Path) -> None:
    """.pt (uint8 bytes, torch.load weights_only + mmap), sharded safetensors and a fused
    tau_wqwv all load to exactly the single safetensors file's tensors."""
    want = load_state_dict(MD3_FP8, CONFIG)
    path = write_fp8_checkpoint(
        MD3, tmp_path, pt=form.startswith("pt"), shards=3 if form == "sharded" else 1,
        fused_tau="fused" in form,
    )  # fmt: skip
    assert path.name == {"pt": "model_fp8.pt", "sharded": "model.safetensors.index.json"}.get(
        form.split("_")[0], "model.safetensors"
    )
    _same(load_state_dict(tmp_path, CONFIG), want)
    _same(load_state_dict(path, CONFIG), want)


def test_moe_weights_modes(native, tmp_path: Path) -> None:
    """dequantize: q.float() * scale in the model dtype; fp8 on a 16-bit file quantises at load
    to the same bytes the writer stores; None keeps what the file holds."""
    fp8 = load_state_dict(MD3_FP8, CONFIG)
    deq = load_state_dict(MD3_FP8, CONFIG, moe_weights="dequantize", dtype=torch.bfloat16)
    name = "text.blocks.2.mlp.fc2"
    want = (fp8[f"{name}.weight"].float() * fp8[f"{name}.scale"][..., None]).bfloat16()
    assert deq[f"{name}.weight"].dtype == torch.bfloat16 and f"{name}.scale" not in deq
    assert torch.equal(deq[f"{name}.weight"], want)
    made = load_state_dict(MD3, CONFIG, moe_weights="fp8")
    _same(made, fp8)
    assert load_state_dict(MD3, CONFIG)["text.blocks.1.mlp.fc1.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="moe_weights must be one of"):
        load_state_dict(MD3, CONFIG, moe_weights="int8")
    model = MoondreamModel.from_pretrained(MD3_FP8, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.text.blocks[1].moe.fp8
    assert model.text.blocks[1].moe.up.dtype == FP8_DTYPE  # experts keep their form on a cast
    assert model.to(dtype=torch.float32).text.blocks[1].moe.up_scale.dtype == torch.float32


def test_region_ln_when_present(published, tmp_path: Path) -> None:
    """A file with region_model.ln gets a LayerNorm before both region decoders; without it
    the decoders read the hidden state as is (the reference)."""
    ln = {
        "region_model.ln.weight": torch.full((128,), 2.0),
        "region_model.ln.bias": torch.ones(128),
    }
    with_ln = MoondreamModel.from_pretrained(_write(tmp_path, {**published, **ln}))
    without = MoondreamModel.from_pretrained(MD3_FP8)
    assert without.region.ln is None and with_ln.region.ln is not None
    h = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    want = linear(layer_norm(h, with_ln.region.ln), with_ln.region.coord_decoder)
    assert_close(decode_coordinate(h, with_ln.region), want)
    assert_close(decode_coordinate(h, without.region), linear(h, without.region.coord_decoder))


def _drop(sd: dict, *keys: str) -> dict:
    return {k: v for k, v in sd.items() if k not in keys}


def _scaled(sd: dict, key: str, value: float, at=(0, 0)) -> dict:
    t = sd[key].clone()
    t[at] = value
    return {**sd, key: t}


UP, DOWN = f"{L}.1.moe_quant.up_scale", f"{L}.1.moe_quant.down_scale"
EXPERTS = f"{L}.1.mlp.experts.weight"
HOSTILE = {
    "scale_wrong_shape": (lambda sd: {**sd, UP: torch.ones(8, 63)}, UP, "has shape"),
    "nan_scale": (lambda sd: _scaled(sd, UP, float("nan")), UP, "not finite and positive"),
    "inf_scale": (lambda sd: _scaled(sd, DOWN, float("inf"), (3, 5)), DOWN, r"index \[3, 5\]"),
    "zero_scale": (lambda sd: _scaled(sd, DOWN, 0.0), DOWN, "not finite and positive"),
    "negative_scale": (lambda sd: _scaled(sd, UP, -1.0), UP, "positive finite"),
    "int_scale": (lambda sd: {**sd, UP: sd[UP].to(torch.int32)}, UP, "dtype torch.int32"),
    "16bit_experts_beside_scales": (
        lambda sd: {**sd, EXPERTS: sd[EXPERTS].to(torch.bfloat16)}, EXPERTS, "BF16",
    ),
    "fp8_experts_without_scales": (
        lambda sd: _drop(sd, *[k for k in sd if "moe_quant" in k]), EXPERTS, "no moe_quant scales"
    ),
    "scales_in_one_layer_only": (
        lambda sd: _drop(sd, f"{L}.2.moe_quant.up_scale", f"{L}.2.moe_quant.down_scale"),
        f"{L}.2.moe_quant.up_scale", "mixes expert forms",
    ),
    "one_scale_of_a_layer": (lambda sd: _drop(sd, DOWN), DOWN, "mixes expert forms"),
    "fused_and_separate_tau": (
        lambda sd: {**sd, f"{L}.0.tau_wqwv": torch.zeros(4, 384)}, f"{L}.0.tau_wqwv", "mixes tau"
    ),
    "native_and_legacy_keys": (
        lambda sd: {**sd, "model.text.wte": torch.zeros(768, 128)}, "model.text.wte", "mixes the"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_files_are_refused(case: str, published, tmp_path: Path) -> None:
    make, names, match = HOSTILE[case]
    path = _write(tmp_path, make(dict(published)))
    with pytest.raises(CheckpointError, match=match) as err:
        load_state_dict(path, CONFIG)
    assert names in str(err.value)


def test_fused_tau_of_the_wrong_shape(published, tmp_path: Path) -> None:
    sd = _drop(published, f"{L}.1.tau_wq", f"{L}.1.tau_wv")
    path = _write(tmp_path, {**sd, f"{L}.1.tau_wqwv": torch.zeros(3, 384)})
    with pytest.raises(CheckpointError, match=r"fused tau tensor .*h\.1\.tau_wqwv.* \[4, 384\]"):
        load_state_dict(path, CONFIG)


class _Payload:
    """A pickled object whose unpickling would run code (write a file)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.write_text, (self.target, "ran"))


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("payload", "cannot read .* as a torch tensor dict"),
        ([torch.zeros(2)], "holds a list, not a dict of tensors"),
        ({"text_model.transformer.embd.wte.weight": 1}, "entry .*wte.weight.* is a int"),
        ({"nested": {"a": torch.zeros(1)}}, "entry 'nested' is a dict"),
    ],
    ids=["code_object", "list", "int_entry", "nested_dict"],
)
def test_pt_must_be_a_plain_tensor_dict(content, match: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    obj = _Payload(marker) if content == "payload" else content
    torch.save(obj, tmp_path / "model_fp8.pt")
    shutil.copy(MD3 / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=match):
        load_state_dict(tmp_path, CONFIG)
    assert not marker.exists()  # nothing was executed


PREVIEW = ["config.json", "model_fp8.pt", "model.safetensors.index.json",
           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
           "hf_moondream.py", "README.md"]  # fmt: skip
V31 = ["config.json", "model.safetensors", "hf_moondream.py", "README.md"]


@pytest.mark.parametrize(
    ("repo", "files", "prefer_fp8", "fetched"),
    [
        ("moondream/moondream3.1-9B-A2B", V31, False, ["model.safetensors"]),
        ("moondream/moondream3.1-9B-A2B", V31, True, ["model.safetensors"]),
        ("moondream/moondream3-preview", PREVIEW, False, PREVIEW[2:5]),
        ("moondream/moondream3-preview", PREVIEW, True, ["model_fp8.pt"]),
        ("moondream/moondream3-preview", ["config.json", "model_fp8.pt"], False, ["model_fp8.pt"]),
    ],
    ids=["3.1", "3.1-fp8", "preview", "preview-fp8", "preview-only-fp8"],
)
def test_hub_ids_resolve_to_their_file(
    repo, files, prefer_fp8, fetched, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """3.1's one model.safetensors (FP8 inside); the preview's 16-bit shards by default, its
    model_fp8.pt when FP8 is asked for (or when it is the only weights file)."""
    from kestrel.moondream.weights import resolve_checkpoint

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = FakeHub(files, tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    shards = {"a": PREVIEW[3], "b": PREVIEW[4]}
    for name in fetched:  # what the download would have left in the snapshot
        (tmp_path / name).write_text(json.dumps({"weight_map": shards}))
    got = resolve_checkpoint(repo, prefer_fp8=prefer_fp8)
    patterns = hub.downloads[-1]["allow_patterns"]
    assert sorted(f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)) == sorted(
        ["config.json", *fetched]
    )
    fp8_path = prefer_fp8 and "model_fp8.pt" in fetched
    assert got == (tmp_path / "model_fp8.pt" if fp8_path else tmp_path)

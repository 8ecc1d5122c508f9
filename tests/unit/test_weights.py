from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.hub import CHECKPOINT_FILES
from kestrel.moondream.weights import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_dtype,
    expected_shapes,
    load_config,
    load_state_dict,
    resolve_checkpoint,
)


def fixture_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "fixtures" / "md2-tiny-a"
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", default))


@pytest.fixture(scope="module")
def config() -> MoondreamConfig:
    return load_config(fixture_dir())


@pytest.fixture(scope="module")
def raw() -> dict[str, torch.Tensor]:
    """The fixture file's tensors under their on-disk names (``model.`` prefix)."""
    return load_file(fixture_dir() / "model.safetensors")


def write(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    return tmp_path


def test_expected_shapes_production_counts() -> None:
    shapes = expected_shapes(MoondreamConfig())
    assert len(shapes) == 592  # architecture doc 7.1
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 1_927_237_104
    assert shapes["vision.pos_emb"] == (1, 729, 1152)
    assert shapes["vision.proj_mlp.fc1.weight"] == (8192, 2304)
    assert shapes["text.wte"] == (51200, 2048)
    assert shapes["text.blocks.23.attn.qkv.weight"] == (6144, 2048)
    assert shapes["region.coord_features"] == (1, 128)
    assert shapes["region.size_features"] == (2, 256)
    assert "text.wte.weight" not in shapes and "text.blocks.24.ln.weight" not in shapes


def test_fixture_loads(config: MoondreamConfig, raw: dict[str, torch.Tensor]) -> None:
    sd = load_state_dict(fixture_dir(), config)
    shapes = expected_shapes(config)
    assert len(sd) == len(shapes) == len(raw) == 372
    assert list(sd) == list(shapes)
    assert sum(t.numel() for t in sd.values()) == 1_485_728
    for name, tensor in sd.items():
        assert tuple(tensor.shape) == shapes[name], name
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, raw["model." + name]), name
    assert sd["text.lm_head.bias"][0].item() == -50.0  # the fixture's deliberate eos bias
    assert checkpoint_dtype(fixture_dir()) == torch.float32


def test_cast_to_bfloat16(config: MoondreamConfig, raw: dict[str, torch.Tensor]) -> None:
    sd = load_state_dict(fixture_dir() / "model.safetensors", config, dtype=torch.bfloat16)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert all(t.is_contiguous() for t in sd.values())
    assert torch.equal(sd["text.wte"], raw["model.text.wte"].to(torch.bfloat16))


def test_checkpoint_dtype_from_header(tmp_path: Path) -> None:
    write(tmp_path, {"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(2)})
    assert checkpoint_dtype(tmp_path) == torch.bfloat16  # most elements
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="header"):
        checkpoint_dtype(tmp_path)


def test_missing_file(tmp_path: Path, config: MoondreamConfig) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*model\.safetensors"):
        load_state_dict(tmp_path, config)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "x.safetensors"))):
        load_state_dict(tmp_path / "x.safetensors", config)


def test_missing_keys(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    drop = {"model.text.post_ln.bias", "model.vision.blocks.26.mlp.fc2.weight"}
    write(tmp_path, {k: v for k, v in raw.items() if k not in drop})
    with pytest.raises(CheckpointError, match="lacks 2 of the 372") as err:
        load_state_dict(tmp_path, config)
    assert "text.post_ln.bias" in str(err.value)
    assert "vision.blocks.26.mlp.fc2.weight" in str(err.value)


def test_config_with_more_layers_than_checkpoint(config: MoondreamConfig) -> None:
    bigger = replace(config, text=replace(config.text, n_layers=3))
    with pytest.raises(CheckpointError, match=r"lacks 10 of the 382.*text\.blocks\.2\."):
        load_state_dict(fixture_dir(), bigger)


def test_extra_keys_warn_or_raise(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    write(
        tmp_path, {**raw, "model.text.rotary_cache": torch.zeros(4), "extra.thing": torch.ones(1)}
    )
    with pytest.warns(CheckpointWarning, match=r"2 tensor\(s\).*model\.text\.rotary_cache"):
        sd = load_state_dict(tmp_path, config)
    assert len(sd) == 372 and "text.rotary_cache" not in sd
    with pytest.raises(CheckpointError, match="strict"):
        load_state_dict(tmp_path, config, strict=True)


def test_shape_mismatch_names_key_and_shapes(tmp_path: Path, config: MoondreamConfig, raw) -> None:
    write(tmp_path, {**raw, "model.text.wte": torch.zeros(1023, 128)})
    with pytest.raises(CheckpointError) as err:
        load_state_dict(tmp_path, config)
    msg = str(err.value)
    assert "model.text.wte" in msg and "[1023, 128]" in msg and "[1024, 128]" in msg


def test_production_config_on_tiny_checkpoint_fails_clearly() -> None:
    with pytest.raises(CheckpointError, match=r"shape|lacks"):
        load_state_dict(fixture_dir(), MoondreamConfig())


def test_int4_rejected(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    packed = {
        "model.text.blocks.0.attn.qkv.weight.packed": torch.zeros(2, 128, dtype=torch.uint8),
        "model.text.blocks.0.attn.qkv.weight.scale": torch.ones(4, 1),
    }
    write(tmp_path, {**raw, **packed})
    with pytest.raises(CheckpointError, match="int4 group_size checkpoints are not supported"):
        load_state_dict(tmp_path, config)
    quantized = replace(config, text=replace(config.text, group_size=128))
    with pytest.raises(CheckpointError, match="int4 group_size checkpoints are not supported"):
        load_state_dict(fixture_dir(), quantized)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file(tmp_path: Path, config: MoondreamConfig, damage: str) -> None:
    data = (fixture_dir() / "model.safetensors").read_bytes()
    corrupt = {"garbage": b"\x07" * 4096, "truncated": data[: len(data) // 2], "empty": b""}
    (tmp_path / "model.safetensors").write_bytes(corrupt[damage])
    with pytest.raises(CheckpointError, match=r"corrupt|cannot read"):
        load_state_dict(tmp_path, config)


def test_unrecognized_layout(tmp_path: Path, config: MoondreamConfig) -> None:
    write(tmp_path, {"encoder.layer.0.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="not a Moondream 2 checkpoint"):
        load_state_dict(tmp_path, config)


def test_duplicate_names(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    write(tmp_path, {**raw, "text.wte": raw["model.text.wte"].clone()})
    with pytest.raises(CheckpointError, match="twice"):
        load_state_dict(tmp_path, config)


def test_orig_mod_is_stripped(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    renamed = {k.replace("model.text.", "model.text._orig_mod.", 1): v for k, v in raw.items()}
    write(tmp_path, renamed)
    sd = load_state_dict(tmp_path, config)
    assert torch.equal(
        sd["text.blocks.1.attn.qkv.weight"], raw["model.text.blocks.1.attn.qkv.weight"]
    )


# Legacy (training) names, written out independently of the loader's rules (architecture 7.2).
_LEGACY_FIXED = {
    "vision.pos_emb": "vision_encoder.encoder.model.visual.pos_embed",
    "text.wte": "text_model.transformer.embd.wte.weight",
    "region.coord_features": "region_model.coordinate_features.weight",
    "region.size_features": "region_model.size_features.weight",
}
_LEGACY_PARTS = [
    (r"^vision\.patch_emb\.(\w+)$", "vision_encoder.encoder.model.visual.patch_embed.linear.{0}"),
    (r"^vision\.post_ln\.(\w+)$", "vision_encoder.encoder.model.visual.norm.{0}"),
    (r"^vision\.proj_mlp\.(fc\d)\.(\w+)$", "vision_encoder.projection.mlp.{0}.{1}"),
    (
        r"^vision\.blocks\.(\d+)\.ln(\d)\.(\w+)$",
        "vision_encoder.encoder.model.visual.blocks.{0}.norm{1}.{2}",
    ),
    (r"^vision\.blocks\.(\d+)\.(.+)$", "vision_encoder.encoder.model.visual.blocks.{0}.{1}"),
    (r"^text\.blocks\.(\d+)\.attn\.qkv\.(\w+)$", "text_model.transformer.h.{0}.mixer.Wqkv.{1}"),
    (
        r"^text\.blocks\.(\d+)\.attn\.proj\.(\w+)$",
        "text_model.transformer.h.{0}.mixer.out_proj.{1}",
    ),
    (r"^text\.blocks\.(\d+)\.(.+)$", "text_model.transformer.h.{0}.{1}"),
    (r"^text\.post_ln\.(\w+)$", "text_model.lm_head.ln.{0}"),
    (r"^text\.lm_head\.(\w+)$", "text_model.lm_head.linear.{0}"),
    (r"^region\.coord_(\w+)\.(.+)$", "region_model.coordinate_{0}.{1}"),
    (r"^region\.size_(\w+)\.(.+)$", "region_model.size_{0}.{1}"),
]


def legacy_name(native: str) -> str:
    if native in _LEGACY_FIXED:
        return _LEGACY_FIXED[native]
    for pattern, template in _LEGACY_PARTS:
        m = re.match(pattern, native)
        if m:
            return template.format(*m.groups())
    raise AssertionError(native)


def test_legacy_layout_round_trip(tmp_path: Path, config: MoondreamConfig, raw: dict) -> None:
    legacy = {}
    for key, tensor in raw.items():
        native = key.removeprefix("model.")
        is_feature = native in ("region.coord_features", "region.size_features")
        legacy[legacy_name(native)] = tensor.T if is_feature else tensor
    assert legacy["region_model.size_features.weight"].shape == (256, 2)
    # torch.compile wrappers leave "._orig_mod" in some training checkpoints.
    legacy = {k.replace("text_model.", "text_model._orig_mod.", 1): v for k, v in legacy.items()}
    write(tmp_path, legacy)
    sd = load_state_dict(tmp_path, config)
    assert list(sd) == list(expected_shapes(config))
    for name, tensor in sd.items():
        assert torch.equal(tensor, raw["model." + name]), name
        assert tensor.is_contiguous()

    features = "region_model.coordinate_features.weight"
    write(tmp_path, {**legacy, features: legacy[features].T})  # stored untransposed: wrong
    with pytest.raises(CheckpointError, match=r"\[1, 128\].*\[128, 1\].*transposed"):
        load_state_dict(tmp_path, config)

    del legacy["text_model._orig_mod.transformer.h.1.mixer.out_proj.bias"]
    write(tmp_path, legacy)
    with pytest.raises(CheckpointError, match=r"legacy layout.*h\.1\.mixer\.out_proj\.bias"):
        load_state_dict(tmp_path, config)


def test_resolve_local_paths(tmp_path: Path) -> None:
    assert resolve_checkpoint(fixture_dir()) == fixture_dir()
    assert resolve_checkpoint(str(fixture_dir() / "model.safetensors")).is_file()
    with pytest.raises(CheckpointError, match="no such checkpoint path"):
        resolve_checkpoint(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="no such checkpoint path"):
        resolve_checkpoint(tmp_path / "also" / "missing")


def test_resolve_hub_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Works with or without huggingface_hub installed: both paths must explain the local option.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="pass that directory's path") as err:
        resolve_checkpoint("kestrel-test/no-such-model")
    assert "model.safetensors and config.json" in str(err.value)


def test_resolve_hub_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # makes the import fail
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"pip install 'kestrel\[hub\]'") as err:
        resolve_checkpoint("vikhyatk/moondream2")
    assert "pass that directory's path" in str(err.value)


def test_resolve_hub_network_error_and_success(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    calls = []

    def failing(repo_id: str, **kwargs: object) -> str:
        calls.append((repo_id, kwargs))
        raise ConnectionError("network unreachable")

    fake = types.ModuleType("huggingface_hub")
    fake.snapshot_download = failing  # type: ignore[attr-defined]
    fake.list_repo_files = lambda repo_id, revision: ["model.safetensors"]  # type: ignore
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    with pytest.raises(CheckpointError, match="ConnectionError: network unreachable"):
        resolve_checkpoint("vikhyatk/moondream2", revision="abc")
    repo_id, kwargs = calls[0]
    assert repo_id == "vikhyatk/moondream2" and kwargs["revision"] == "abc"
    assert kwargs["local_files_only"] is False
    assert "model.safetensors" in kwargs["allow_patterns"]

    fake.snapshot_download = lambda repo_id, **kw: str(tmp_path)  # type: ignore[attr-defined]
    assert resolve_checkpoint("vikhyatk/moondream2") == tmp_path


SHARDS = ["model.safetensors.index.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors"]  # fmt: skip
REPO_EXTRAS = ["config.json", "tokenizer.json", "hf_moondream.py", "README.md", "model_fp8.pt"]


class FakeHub(types.ModuleType):
    """huggingface_hub's two calls, recorded; ``files`` None makes the listing fail."""

    def __init__(self, files: list[str] | None, snapshot: Path) -> None:
        super().__init__("huggingface_hub")
        self.files, self.snapshot = files, snapshot
        self.listed: list[str | None] = []
        self.downloads: list[dict] = []

    def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
        self.listed.append(revision)
        if self.files is None:
            raise ConnectionError("listing refused")
        return self.files

    def snapshot_download(self, repo_id: str, **kwargs: object) -> str:
        self.downloads.append(kwargs)
        return str(self.snapshot)


@pytest.mark.parametrize(
    ("repo_files", "fetched"),
    [
        (["model.safetensors", *SHARDS], ["model.safetensors"]),  # both forms: the single file
        (["model.safetensors"], ["model.safetensors"]),
        (SHARDS, SHARDS),
    ],
    ids=["both", "single", "sharded"],
)
def test_hub_fetches_one_weights_form(
    repo_files: list[str], fetched: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The repo's file list is read first; snapshot_download gets patterns for one form only."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = FakeHub([*repo_files, *REPO_EXTRAS], tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    sharded = fetched == SHARDS
    for name in fetched:  # what the download leaves in the snapshot
        (tmp_path / name).write_text(json.dumps({"weight_map": {"a": SHARDS[1], "b": SHARDS[2]}}))
    assert resolve_checkpoint("moondream/moondream3-preview", revision="r1") == tmp_path
    # sharded: the index alone first, then the shards it names
    assert hub.listed == ["r1"] and len(hub.downloads) == 1 + sharded
    assert not sharded or hub.downloads[0]["allow_patterns"] == [SHARDS[0]]
    patterns = hub.downloads[-1]["allow_patterns"]
    assert isinstance(patterns, list)
    got = [f for f in hub.files or [] if any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert got == [*fetched, "config.json", "tokenizer.json"]


def test_hub_listing_failure_and_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed listing gives the usual message; offline nothing is listed and the cache is
    asked for every checkpoint file (it holds whichever form was fetched before)."""
    hub = FakeHub(None, tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(CheckpointError, match="ConnectionError: listing refused") as err:
        resolve_checkpoint("moondream/moondream3-preview")
    assert "pass that directory's path" in str(err.value) and hub.downloads == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_checkpoint("moondream/moondream3-preview") == tmp_path
    assert hub.listed == [None]  # only the failed call above
    assert hub.downloads[0]["local_files_only"] is True
    assert set(hub.downloads[0]["allow_patterns"]) == set(CHECKPOINT_FILES)


@pytest.mark.gpu
def test_load_to_cuda_in_bfloat16(config: MoondreamConfig, raw: dict) -> None:
    sd = load_state_dict(fixture_dir(), config, device="cuda", dtype=torch.bfloat16)
    assert {t.device.type for t in sd.values()} == {"cuda"}
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert torch.equal(sd["text.wte"].cpu(), raw["model.text.wte"].to(torch.bfloat16))

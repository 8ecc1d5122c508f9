"""Sharded checkpoints (``model.safetensors.index.json``): both families, float32 and bf16."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.moondream import MoondreamModel
from kestrel.moondream.hub import CHECKPOINT_FILES
from kestrel.moondream.weights import (
    CheckpointError,
    checkpoint_dtype,
    detect_family,
    load_config,
    load_state_dict,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
INDEX = "model.safetensors.index.json"


def shard(src: Path, out: Path, n: int, dtype: torch.dtype, *, config: bool = True) -> Path:
    """Split ``src``'s model.safetensors into ``n`` shards + index, as the hub stores them."""
    out.mkdir(parents=True)
    tensors = {k: v.to(dtype) for k, v in load_file(src / "model.safetensors").items()}
    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, name in enumerate(names):
        part = keys[i::n]
        save_file({k: tensors[k] for k in part}, str(out / name))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index))
    shutil.copy(src / "tokenizer.json", out)
    if config:
        shutil.copy(src / "config.json", out)
    return out


@pytest.mark.parametrize(
    ("fixture", "n", "dtype"),
    [("md2-tiny-a", 3, torch.float32), ("md3-tiny-a", 2, torch.bfloat16)],
)
def test_sharded_equals_single(fixture: str, n: int, dtype: torch.dtype, tmp_path: Path) -> None:
    src = FIXTURES / fixture
    if dtype == torch.float32:
        single_dir = src
    else:  # the same tensors as one bf16 file, for the comparison
        single_dir = tmp_path / "single"
        single_dir.mkdir()
        sd = {k: v.to(dtype) for k, v in load_file(src / "model.safetensors").items()}
        save_file(sd, str(single_dir / "model.safetensors"))
        shutil.copy(src / "config.json", single_dir)
    out = shard(src, tmp_path / "sharded", n, dtype)
    assert len(list(out.glob("model-*.safetensors"))) == n
    config = load_config(out)
    assert config == load_config(src)
    assert checkpoint_dtype(out) == dtype
    single = load_state_dict(single_dir, config)
    for path in (out, out / INDEX):
        sharded = load_state_dict(path, config)
        assert sharded.keys() == single.keys()
        for name, tensor in single.items():
            assert sharded[name].dtype == dtype and torch.equal(sharded[name], tensor), name


def test_sharded_md3_family_from_keys_and_model_loads(tmp_path: Path) -> None:
    src = FIXTURES / "md3-tiny-a"
    out = shard(src, tmp_path / "m", 3, torch.float32)
    assert detect_family(out) == "moondream3" and detect_family(out / INDEX) == "moondream3"
    (out / "config.json").unlink()  # no config: the shards' tensors decide the family
    assert load_config(out).family == "moondream3"
    shutil.copy(src / "config.json", out)
    model = MoondreamModel.from_pretrained(out)
    reference = MoondreamModel.from_pretrained(src)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def _index(out: Path) -> dict:
    return json.loads((out / INDEX).read_text())


def test_missing_shard(tmp_path: Path) -> None:
    out = shard(FIXTURES / "md2-tiny-a", tmp_path / "m", 3, torch.float32)
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.*incomplete download"):
        load_state_dict(out, load_config(out))


def test_index_disagrees_with_shards(tmp_path: Path) -> None:
    out = shard(FIXTURES / "md2-tiny-a", tmp_path / "m", 2, torch.float32)
    index = _index(out)
    index["weight_map"]["model.text.wte"] = "model-00002-of-00002.safetensors"
    (out / INDEX).write_text(json.dumps(index))
    expected = "maps 'model.text.wte' to model-00002-of-00002.safetensors, but model-0000"
    with pytest.raises(CheckpointError, match=expected):
        load_state_dict(out, load_config(out))
    index["weight_map"]["model.text.unheard_of"] = "model-00001-of-00002.safetensors"
    del index["weight_map"]["model.text.wte"]
    (out / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'model\.text\.unheard_of'.*but no shard holds it"):
        load_state_dict(out, load_config(out))


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    out = shard(FIXTURES / "md2-tiny-a", tmp_path / "m", 2, torch.float32)
    second = out / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    tensors["model.text.wte"] = torch.zeros(1)
    save_file(tensors, str(second))
    with pytest.raises(CheckpointError, match=r"'model\.text\.wte' is stored in both"):
        load_state_dict(out, load_config(out))


@pytest.mark.parametrize("bad", ["{", '{"weight_map": {}}', '{"metadata": {}}'])
def test_unreadable_index(bad: str, tmp_path: Path) -> None:
    out = shard(FIXTURES / "md2-tiny-a", tmp_path / "m", 2, torch.float32)
    (out / INDEX).write_text(bad)
    with pytest.raises(CheckpointError, match="cannot read the shard index"):
        load_state_dict(out, load_config(out))


def test_single_file_wins_over_index(tmp_path: Path) -> None:
    src = FIXTURES / "md2-tiny-a"
    out = shard(src, tmp_path / "m", 2, torch.float32)
    (out / "model-00001-of-00002.safetensors").unlink()  # the index alone would fail
    shutil.copy(src / "model.safetensors", out)
    config = load_config(out)
    assert load_state_dict(out, config).keys() == load_state_dict(src, config).keys()


def test_hub_downloads_the_shards_and_index() -> None:
    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in CHECKPOINT_FILES)

    for name in (INDEX, "model-00001-of-00004.safetensors", "model.safetensors", "config.json"):
        assert fetched(name), name
    for name in ("model_fp8.pt", "hf_moondream.py", "README.md"):
        assert not fetched(name), name

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kestrel.moondream.config import ConfigError, MoondreamConfig
from kestrel.moondream.weights import CheckpointError, load_config


def fixture_dir() -> Path:
    # Same rule as tests/conftest.py (which is not importable as a module from here).
    default = Path(__file__).resolve().parents[1] / "fixtures" / "md2-tiny-a"
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", default))


def test_defaults_are_production_md2() -> None:
    c = MoondreamConfig()
    assert (c.text.dim, c.text.n_layers, c.text.n_heads, c.text.vocab_size) == (2048, 24, 32, 51200)
    assert (c.text.head_dim, c.text.rotary_dim, c.text.qkv_dim) == (64, 32, 6144)
    assert (c.vision.enc_dim, c.vision.enc_n_layers, c.vision.enc_n_heads) == (1152, 27, 16)
    assert (c.vision.grid_side, c.vision.n_patches, c.vision.patch_dim) == (27, 729, 588)
    assert (c.region.coord_bins, c.region.size_bins) == (1024, 1024)
    assert (c.image_tokens, c.prefix_len) == (729, 730)
    assert c.tokenizer.templates["query"]["prefix"] == (1, 15381, 2)
    assert MoondreamConfig.from_dict({}) == c


def test_fixture_config_matches_golden() -> None:
    golden = json.loads((fixture_dir() / "golden.json").read_text())["config"]
    c = load_config(fixture_dir())
    assert c == MoondreamConfig.from_dict(golden)
    assert (c.text.dim, c.text.n_layers, c.text.vocab_size) == (128, 2, 1024)
    assert (c.vision.enc_dim, c.vision.enc_n_layers, c.vision.grid_side) == (32, 27, 27)
    assert c.tokenizer.templates["detect"]["prefix"] == (1, 461, 464, 2)
    # load_config accepts the directory, the weights file and the config file alike.
    assert load_config(fixture_dir() / "model.safetensors") == c
    assert load_config(fixture_dir() / "config.json") == c


def test_partial_config_falls_back_to_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"config": {"text": {"n_layers": 3}}}))
    c = load_config(tmp_path)
    assert c.text.n_layers == 3
    assert c.text.dim == 2048 and c.vision == MoondreamConfig().vision


def test_top_level_sections_accepted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vision": {"max_crops": 6}}))
    assert load_config(tmp_path).vision.max_crops == 6


def test_missing_config_json_means_production_defaults(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_config(tmp_path) == MoondreamConfig()
    assert load_config(tmp_path / "model.safetensors") == MoondreamConfig()
    with pytest.raises(CheckpointError, match="no config"):
        load_config(tmp_path / "nowhere" / "config.json")


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"text": {"dimm": 3}}, r"unknown field.*dimm.*text"),
        ({"txt": {}}, r"unknown config section.*txt"),
        ({"tokenizer": {"bos": 1}}, r"unknown field.*bos"),
    ],
)
def test_unknown_fields_are_errors(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoondreamConfig.from_dict(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"text": {"dim": 100, "n_heads": 3}}, "not divisible"),
        ({"text": {"n_heads": 32, "n_kv_heads": 5}}, "multiple of n_kv_heads"),
        ({"vision": {"crop_size": 380}}, "multiple of enc_patch_size"),
        ({"vision": {"enc_n_heads": 7}}, "divisible by enc_n_heads"),
        ({"vision": {"overlap_margin": 14}}, "no crop window"),
        ({"vision": {"proj_out_dim": 1024}}, "proj_out_dim must equal text.dim"),
        ({"region": {"dim": 1024}}, "region.dim must equal text.dim"),
        ({"text": {"max_context": 512}}, "max_context"),
        ({"tokenizer": {"templates": {"query": {"prefix": [1]}}}}, "lacks the 'caption'"),
    ],
)
def test_bad_values_are_errors(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MoondreamConfig.from_dict(data)


def test_corrupt_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)

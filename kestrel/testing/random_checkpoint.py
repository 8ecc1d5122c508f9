"""Random-weight checkpoints of Moondream 2 or 3 structure, written in the Hugging Face layout.

Used by benchmarks and tests: no real weights can be downloaded here, but everything downstream
of the loader (shapes, dtypes, the runtime's cost profile) is that of a real checkpoint of the
given config. The files go through the normal loader, so a bench model exercises it too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path

import torch
from safetensors.torch import save_file

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.weights import expected_shapes

__all__ = ["config_to_dict", "write_random_checkpoint"]


def config_to_dict(config: MoondreamConfig) -> dict:
    """The nested ``config.json["config"]`` form of a config (inverse of ``from_dict``)."""
    out: dict = {}
    for section in ("text", "vision", "region", "tokenizer"):
        obj = getattr(config, section)
        data = {f.name: getattr(obj, f.name) for f in fields(obj)}
        if section == "text" and config.text.moe is not None:  # Moondream 3's MoE section
            data["moe"] = asdict(config.text.moe)
        if section == "tokenizer":
            data["templates"] = {
                skill: {k: list(v) for k, v in parts.items()}
                for skill, parts in obj.templates.items()
            }
        out[section] = data
    return out


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    is_norm = ".ln" in name or "post_ln" in name
    if is_norm and leaf == "weight":
        return torch.ones(shape)
    if leaf == "bias":
        return torch.randn(shape, generator=gen) * 0.02
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def write_random_checkpoint(
    out_dir: str | Path, config: MoondreamConfig, *, seed: int = 0, dtype=torch.float32
) -> Path:
    """Write ``model.safetensors`` + ``config.json`` for ``config`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        f"model.{name}": _init(name, tuple(shape), gen).to(dtype).contiguous()
        for name, shape in sorted(expected_shapes(config).items())
    }
    save_file(tensors, str(out / "model.safetensors"))
    meta = {
        "architectures": ["HfMoondream"],
        "config": config_to_dict(config),
        "model_type": "moondream3" if config.family == "moondream3" else "moondream1",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (out / "config.json").write_text(json.dumps(meta, indent=2))
    return out

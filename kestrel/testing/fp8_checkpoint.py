"""Write any Moondream 3 checkpoint in the form its FP8 releases are published in.

The published form (``moondream3-preview``'s ``model_fp8.pt``, ``moondream3.1``'s
``model.safetensors``): legacy key names (``text_model.transformer.h.N...``), every MoE layer's
experts as float8_e4m3 with float32 per-output-row scales ``moe_quant.up_scale`` [E, 2 * inner]
and ``moe_quant.down_scale`` [E, dim], everything else unquantised. Scales here are plain
absmax / 448 per row (``moondream.fp8.quantize_rows``); the releases refine theirs further, which
changes the values, not the format, so a plain absmax file is enough to exercise a loader.

    python -m kestrel.testing.fp8_checkpoint SRC OUT [--pt] [--shards N] [--fused-tau]
        [--region-ln] [--dtype bfloat16]

``--pt`` writes ``model_fp8.pt`` (a ``torch.save`` dict, experts as uint8 bytes as a pickle
may hold them) instead of ``model.safetensors``; ``--shards N`` a sharded safetensors set;
``--fused-tau`` stores each layer's tau as one ``tau_wqwv``; ``--region-ln`` adds a unit
``region_model.ln`` (an identity LayerNorm only when the hidden state is already normalised:
it changes the model; for loader tests). config.json and tokenizer.json are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kestrel.moondream.fp8 import quantize_rows
from kestrel.moondream.layout import (
    _TRANSPOSED_IN_LEGACY,
    _legacy_name,
    fp8_scale_shapes,
    tau_fused_name,
)
from kestrel.moondream.weights import load_config, load_state_dict

__all__ = ["fp8_tensors", "write_fp8_checkpoint"]

_COMPANIONS = ("config.json", "tokenizer.json")


def fp8_tensors(
    sd: dict[str, torch.Tensor],
    config,
    *,
    fused_tau: bool = False,
    region_ln: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """A native state dict in the published FP8 form (legacy names, quantised experts)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        stem = name[: -len(".weight")]
        if name.endswith(".weight") and f"{stem}.scale" in _scale_names(config):
            q, scale = quantize_rows(t)
            out[_legacy_name(name, config)] = q
            out[_legacy_name(f"{stem}.scale", config)] = scale
            continue
        fused = tau_fused_name(name) if fused_tau else None
        if fused is not None:
            if fused[1] == 0:  # wq: written once, with wv behind it
                out[fused[0]] = torch.cat([t, sd[name[:-1] + "v"]]).to(dtype or t.dtype)
            continue
        t = t.T if name in _TRANSPOSED_IN_LEGACY else t
        out[_legacy_name(name, config)] = t.to(dtype or t.dtype).contiguous()
    if region_ln:
        dim = config.region.dim
        ref = sd["text.wte"]
        out["region_model.ln.weight"] = torch.ones(dim, dtype=dtype or ref.dtype)
        out["region_model.ln.bias"] = torch.zeros(dim, dtype=dtype or ref.dtype)
    return out


def _scale_names(config) -> set[str]:
    return set(fp8_scale_shapes(config))


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, n: int) -> None:
    keys = list(tensors)
    per = -(-len(keys) // n)
    weight_map = {}
    for i in range(n):
        part = keys[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(out / fname))
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def write_fp8_checkpoint(
    src: str | Path,
    out: str | Path,
    *,
    pt: bool = False,
    shards: int = 1,
    fused_tau: bool = False,
    region_ln: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the checkpoint at ``src`` (any layout the loader reads) in the published FP8 form
    into ``out``; returns the weights file (or the shard index)."""
    src, out = Path(src), Path(out)
    config = load_config(src)
    if config.text.moe is None:
        raise ValueError(f"{src} is not a Moondream 3 checkpoint: it has no experts")
    sd = load_state_dict(src, config)
    tensors = fp8_tensors(sd, config, fused_tau=fused_tau, region_ln=region_ln, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    src_dir = src if src.is_dir() else src.parent
    for name in _COMPANIONS:
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, out / name)
    if pt:
        as_bytes = {
            k: (v.view(torch.uint8) if v.dtype.itemsize == 1 else v) for k, v in tensors.items()
        }
        torch.save(as_bytes, out / "model_fp8.pt")
        return out / "model_fp8.pt"
    if shards > 1:
        _write_shards(tensors, out, shards)
        return out / "model.safetensors.index.json"
    save_file(tensors, str(out / "model.safetensors"))
    return out / "model.safetensors"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--pt", action="store_true", help="write model_fp8.pt (torch.save dict)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--fused-tau", action="store_true")
    p.add_argument("--region-ln", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    path = write_fp8_checkpoint(
        a.src, a.out, pt=a.pt, shards=a.shards, fused_tau=a.fused_tau, region_ln=a.region_ln,
        dtype=dtype,
    )  # fmt: skip
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()

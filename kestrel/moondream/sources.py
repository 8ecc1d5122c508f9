"""Which file tensor feeds each native name: the layout of a checkpoint, its optional parts, and
the checks made on the headers (and the small scale tensors) before any weight is read.

A checkpoint is in the native layout (``text.blocks.N...``, with or without ``model.``) or the
legacy one (``text_model.transformer.h.N...``); never both. On top of the tensors of
:func:`~kestrel.moondream.layout.expected_shapes`, a Moondream 3 file may carry:

- FP8 experts: ``mlp.experts.weight`` / ``mlp.output_experts.weight`` stored as float8_e4m3fn
  (or its uint8 bytes) with their float32 row scales ``moe_quant.up_scale`` [E, 2 * inner] and
  ``moe_quant.down_scale`` [E, dim] in every MoE layer (``moondream.fp8`` says what they mean);
- ``tau_wqwv``: a layer's tau matrices fused, concat(wq, wv) along the heads, instead of
  ``tau_wq`` and ``tau_wv``;
- ``region_model.ln``: a LayerNorm before the region decoders;
- ``kv_quantizer.{k_scale, v_scale}`` per layer: FP8 KV-cache scales (``weights.load_kv_scales``).

Each file must hold one form per layer: a mix (FP8 experts without scales, 16-bit experts
beside scales, scales in some MoE layers only, fused and separate tau together) is refused with
a :class:`CheckpointError` that names the tensor; so is a scale that is not finite and positive.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import MoondreamConfig
from .hub import CheckpointError
from .layout import (
    _TRANSPOSED_IN_LEGACY,
    _legacy_name,
    expected_shapes,
    fp8_scale_shapes,
    region_ln_shapes,
    tau_fused_name,
)
from .shards import ShardReader

__all__ = ["FP8_DTYPE_NAMES", "Source", "SourcePlan", "plan_sources", "read_scales"]

_NATIVE_ROOTS = ("vision.", "text.", "region.")
_LEGACY_ROOTS = ("vision_encoder.", "text_model.", "region_model.")
FP8_DTYPE_NAMES = frozenset({"F8_E4M3", "U8"})  # e4m3 bytes, typed or as uint8 (a .pt)
KV_SCALE = ".kv_quantizer."  # optional FP8 KV-cache scales, one K and one V per layer


@dataclass(frozen=True, slots=True)
class Source:
    """The file ``key`` holding a native tensor; ``half`` 0 / 1 picks the first / second half
    of its first dimension (a fused ``tau_wqwv``), None the whole tensor."""

    key: str
    half: int | None = None


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """native name -> source for every tensor to load, their shapes, the layout, whether the
    experts are FP8, and the file keys nothing reads."""

    sources: dict[str, Source]
    shapes: dict[str, tuple[int, ...]]
    legacy: bool
    fp8: bool
    extra: list[str]


def _native_key(key: str) -> str:
    return key.replace("._orig_mod", "").removeprefix("model.")


def _source_map(keys: list[str], file: Path) -> tuple[dict[str, str], bool]:
    """Detect the layout and map (renamed) names to file keys: (name -> key, legacy?)."""
    stripped = {k: k.replace("._orig_mod", "") for k in keys}
    native = [k for k in keys if _native_key(k).startswith(_NATIVE_ROOTS)]
    old = [k for k, s in stripped.items() if s.startswith(_LEGACY_ROOTS)]
    if native and old:
        raise CheckpointError(
            f"{file} mixes the native layout ({native[0]!r}) and the legacy one ({old[0]!r}); "
            "a checkpoint holds one of them"
        )
    if native:
        legacy, rename = False, {k: _native_key(k) for k in keys}
    elif old:
        legacy, rename = True, stripped
    else:
        raise CheckpointError(
            f"{file} is not a Moondream 2 checkpoint: no key starts with {_NATIVE_ROOTS} "
            f"(native layout) or {_LEGACY_ROOTS} (legacy layout); first keys: {sorted(keys)[:3]}"
        )
    out: dict[str, str] = {}
    for key, name in rename.items():
        if name in out:
            raise CheckpointError(f"{file} holds {name!r} twice (as {out[name]!r} and {key!r})")
        out[name] = key
    return out, legacy


def _wanted_shapes(
    config: MoondreamConfig, by_name: dict[str, str], legacy: bool, file: Path
) -> tuple[dict[str, tuple[int, ...]], bool]:
    """The expected shapes plus the optional parts this file holds; and whether it is FP8."""
    shapes = dict(expected_shapes(config))

    def on_disk(name: str) -> str:
        return _legacy_name(name, config) if legacy else name

    scales = fp8_scale_shapes(config)
    present = [n for n in scales if on_disk(n) in by_name]
    if present and len(present) != len(scales):
        absent = next(n for n in scales if on_disk(n) not in by_name)
        raise CheckpointError(
            f"{file} mixes expert forms: it holds the FP8 scale {by_name[on_disk(present[0])]!r} "
            f"but not {on_disk(absent)!r}; every MoE layer needs both of its scales"
        )
    shapes.update(scales if present else {})
    ln = region_ln_shapes(config)
    if config.region.inner_dim is None and on_disk(next(iter(ln))) in by_name:
        shapes.update(ln)
    return shapes, bool(present)


def _tau_source(name: str, by_name: dict[str, str], file: Path) -> Source | None:
    """The fused ``tau_wqwv`` half for a legacy tau name, if the file holds it."""
    fused = tau_fused_name(name)
    if fused is None or fused[0] not in by_name:
        return None
    return Source(by_name[fused[0]], fused[1])


def plan_sources(keys: list[str], config: MoondreamConfig, file: Path) -> SourcePlan:
    """Map every tensor to load onto the file's keys (raises on a missing one or a mix)."""
    by_name, legacy = _source_map(keys, file)
    shapes, fp8 = _wanted_shapes(config, by_name, legacy, file)
    on_disk = {n: (_legacy_name(n, config) if legacy else n) for n in shapes}
    sources: dict[str, Source] = {}
    for name, disk in on_disk.items():
        fused = _tau_source(name, by_name, file) if legacy else None
        if fused is not None and disk in by_name:
            raise CheckpointError(
                f"{file} mixes tau forms: it holds both {disk!r} and the fused {fused.key!r}"
            )
        if fused is not None:
            sources[name] = fused
        elif disk in by_name:
            sources[name] = Source(by_name[disk])
    missing = [n for n in shapes if n not in sources]
    if missing:
        shown = ", ".join(repr(on_disk[n]) for n in missing[:5])
        raise CheckpointError(
            f"{file} lacks {len(missing)} of the {len(shapes)} tensors the config expects "
            f"({'legacy' if legacy else 'native'} layout), e.g. {shown}; is config.json the one "
            "that belongs to this checkpoint?"
        )
    used = {s.key for s in sources.values()}
    # kv_quantizer scales are known: read on demand by ``weights.load_kv_scales``
    extra = sorted(k for k in by_name.values() if k not in used and KV_SCALE not in k)
    return SourcePlan(sources, shapes, legacy, fp8, extra)


def _stored_shape(reader: ShardReader, name: str, src: Source, legacy: bool) -> tuple:
    shape = reader.shape(src.key)
    if src.half is not None:  # fused tau: [2 * heads, qkv_dim] holds wq then wv
        return (shape[0] // 2, *shape[1:]) if shape and shape[0] % 2 == 0 else (-1, *shape)
    if legacy and name in _TRANSPOSED_IN_LEGACY:
        return shape[::-1]
    return shape


def check_shapes(reader: ShardReader, plan: SourcePlan, file: Path) -> None:
    """Every source tensor has its expected shape (read from the headers only)."""
    for name, src in plan.sources.items():
        shape, want = _stored_shape(reader, name, src, plan.legacy), plan.shapes[name]
        if shape == want:
            continue
        if src.half is not None:
            raise CheckpointError(
                f"{file}: fused tau tensor {src.key!r} has shape {list(reader.shape(src.key))}, "
                f"expected {[2 * want[0], *want[1:]]} (wq and wv concatenated along the heads)"
            )
        if plan.legacy and name in _TRANSPOSED_IN_LEGACY:
            raise CheckpointError(
                f"{file}: legacy tensor {src.key!r} has shape {list(shape[::-1])} but the "
                f"legacy layout stores {name!r} as {list(want[::-1])}, transposed"
            )
        raise CheckpointError(
            f"{file}: tensor {src.key!r} has shape {list(shape)} but the config expects "
            f"{list(want)} for {name!r}; is config.json the one that belongs to this checkpoint?"
        )


def check_expert_forms(reader: ShardReader, plan: SourcePlan, config, file: Path) -> None:
    """FP8 experts come with their scales and 16-bit ones without (from the headers)."""
    stacks = [n for n in plan.sources if n in _expert_stack_names(config)]
    for name in stacks:
        key, stored = plan.sources[name].key, reader.dtype_name(plan.sources[name].key)
        is_fp8 = stored in FP8_DTYPE_NAMES
        if plan.fp8 and not is_fp8:
            scale = plan.sources[f"{name[: -len('.weight')]}.scale"].key
            raise CheckpointError(
                f"{file}: expert tensor {key!r} is {stored}, but the file holds its FP8 scale "
                f"{scale!r}; scaled experts must be float8_e4m3 (a mix of forms is refused)"
            )
        if not plan.fp8 and is_fp8:
            raise CheckpointError(
                f"{file}: expert tensor {key!r} is {stored} (FP8 bytes) but the file holds no "
                "moe_quant scales for it; FP8 experts need their per-row scales"
            )


def _expert_stack_names(config: MoondreamConfig) -> set[str]:
    t = config.text
    return {
        f"text.blocks.{i}.mlp.{fc}.weight"
        for i in range(t.n_layers)
        if t.is_moe_layer(i)
        for fc in ("fc1", "fc2")
    }


def read_scales(reader: ShardReader, plan: SourcePlan, file: Path) -> dict[str, torch.Tensor]:
    """Every FP8 scale as float32, checked finite and positive (a zero scale would erase its
    row; NaN or inf would poison every token routed there)."""
    out: dict[str, torch.Tensor] = {}
    for name, src in plan.sources.items():
        if not name.endswith(".scale"):
            continue
        t = reader.tensor(src.key)
        if not t.is_floating_point():
            raise CheckpointError(f"{file}: scale tensor {src.key!r} has dtype {t.dtype}")
        t = t.float()
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            at = [int(i) for i in bad.nonzero()[0]]
            raise CheckpointError(
                f"{file}: scale tensor {src.key!r} holds {int(bad.sum())} value(s) that are "
                f"not finite and positive (first at index {at}: {float(t[tuple(at)])}); "
                "every FP8 row scale must be a positive finite float"
            )
        out[name] = t.contiguous()
    return out

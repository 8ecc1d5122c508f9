"""Moondream 2 / 3 checkpoint loading: a flat ``{native name: tensor}`` dict checked against
the config.

Native names are the module paths of the reference model without the Hugging Face wrapper's
``model.`` prefix (``vision.blocks.0.attn.qkv.weight``, ``text.wte``, ``region.coord_features``);
:func:`expected_shapes` lists all of them. Two on-disk layouts are read (architecture doc 7.1 and
7.2): the native HF layout of ``vikhyatk/moondream2`` and the older training layout
(``vision_encoder.…``, ``text_model.…``, ``region_model.…``), whose Fourier feature matrices are
stored transposed. ``._orig_mod`` (torch.compile wrappers) is dropped from every name.
Moondream 3's published files (``moondream3-preview``'s ``model_fp8.pt``, ``moondream3.1``'s
``model.safetensors``) are in the legacy layout with FP8 experts and their row scales, maybe a
fused ``tau_wqwv`` and a ``region_model.ln``: ``sources.py`` maps and checks them, ``fp8.py``
says what the scales mean, ``moe_weights`` picks the in-memory form of the experts.

Loading is memory-mapped: tensors are read one at a time, cast and moved once, so the peak host
memory is the result plus one tensor.
"""

from __future__ import annotations

import re
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError

from kestrel_kernels.contract import KvScales

from .config import MOONDREAM2, MOONDREAM3, MoondreamConfig
from .fp8 import as_fp8, dequantize_rows, quantize_rows
from .hub import CheckpointError, download_checkpoint, looks_like_repo_id
from .layout import _TRANSPOSED_IN_LEGACY, expected_shapes
from .shards import FP8_PT_FILE, INDEX_FILE, WEIGHTS_FILE, ShardReader, ShardSet
from .sources import Source, check_expert_forms, check_shapes, plan_sources, read_scales

__all__ = [
    "MOE_WEIGHT_MODES",
    "CheckpointError",
    "CheckpointWarning",
    "check_moe_weights",
    "checkpoint_dtype",
    "detect_family",
    "expected_shapes",
    "load_config",
    "load_kv_scales",
    "load_state_dict",
    "resolve_checkpoint",
]

CONFIG_FILE = "config.json"

_INT4_SUFFIXES = (".weight.packed", ".weight.scale", ".weight.zero_point")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class CheckpointWarning(UserWarning):
    """A checkpoint that loads but holds tensors Kestrel does not use."""


MOE_WEIGHT_MODES = ("fp8", "dequantize")


def _weights_files(path: str | Path) -> ShardSet:
    return ShardSet.locate(Path(path).expanduser())


def _check_not_int4(config: MoondreamConfig, keys: list[str] | None = None) -> None:
    quantized = config.text.group_size is not None or config.region.group_size is not None
    packed = [k for k in keys or () if k.endswith(_INT4_SUFFIXES)]
    if quantized or packed:
        found = f" (found {packed[0]!r} and {len(packed) - 1} more)" if packed else ""
        raise CheckpointError(
            "int4 group_size checkpoints are not supported yet"
            f"{found}; use the unquantized 16-bit model.safetensors of the same release"
        )


def _report_extra(extra: list[str], file: Path, strict: bool) -> None:
    if not extra:
        return
    msg = f"{file} holds {len(extra)} tensor(s) Kestrel does not use, e.g. {extra[:5]}"
    if strict:
        raise CheckpointError(msg + " (strict=True)")
    warnings.warn(msg + "; they are ignored", CheckpointWarning, stacklevel=3)


def check_moe_weights(moe_weights: str | None) -> None:
    if moe_weights is not None and moe_weights not in MOE_WEIGHT_MODES:
        raise ValueError(
            f"moe_weights must be one of {MOE_WEIGHT_MODES} or None (keep what the file "
            f"holds), got {moe_weights!r}"
        )


def _read(reader: ShardReader, src: Source, file: Path) -> torch.Tensor:
    try:
        tensor = reader.tensor(src.key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read tensor {src.key!r} from {file}: {exc}") from exc
    if src.half is not None:
        tensor = tensor.chunk(2, dim=0)[src.half]
    return tensor


def _place_experts(
    name: str,
    tensor: torch.Tensor,
    scales: dict[str, torch.Tensor],
    mode: str | None,
    to: dict,
) -> dict[str, torch.Tensor]:
    """An expert stack as the mode asks: FP8 bytes + scale, or floats (dequantised)."""
    scale_name = name[: -len(".weight")] + ".scale"
    if scale_name in scales:  # FP8 in the file
        q = as_fp8(tensor)
        if mode == "dequantize":
            dtype = to["dtype"] or to["fallback"]
            return {name: dequantize_rows(q, scales[scale_name], dtype).to(to["device"])}
        return {
            name: q.to(device=to["device"]).contiguous(),
            scale_name: scales[scale_name].to(device=to["device"]),
        }
    if mode == "fp8":  # 16-bit in the file, FP8 asked: quantised here, per output row
        q, scale = quantize_rows(tensor)
        return {name: q.to(device=to["device"]), scale_name: scale.to(device=to["device"])}
    return {name: tensor.to(device=to["device"], dtype=to["dtype"] or tensor.dtype).contiguous()}


def load_state_dict(
    path: str | Path,
    config: MoondreamConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    strict: bool = False,
    moe_weights: str | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of :func:`expected_shapes` (plus the optional parts a file carries:
    FP8 expert scales, ``region.ln``) from ``path``: a directory, its ``model.safetensors``, the
    ``model.safetensors.index.json`` of a sharded set, or a ``.pt`` tensor dict.

    ``dtype=None`` keeps the checkpoint's dtype. ``moe_weights``: None keeps the experts in the
    form the file holds them; ``"fp8"`` keeps (or makes, absmax / 448 per row) float8_e4m3
    experts with float32 row scales (``text.blocks.N.mlp.fc1.scale`` / ``fc2.scale``);
    ``"dequantize"`` turns FP8 experts into ``dtype`` floats. Unknown extra tensors are ignored
    with a :class:`CheckpointWarning` (``strict=True`` raises instead). Raises CheckpointError
    for a missing or unreadable file, an index that disagrees with its shards, an unrecognized
    layout, missing tensors, a shape mismatch, a mix of forms, a bad scale, or an int4
    quantized checkpoint. Shapes and forms are checked before any weight is read.
    """
    check_moe_weights(moe_weights)
    shards = _weights_files(path)
    file = shards.source
    _check_not_int4(config)
    out: dict[str, torch.Tensor] = {}
    to = {"device": device, "dtype": dtype, "fallback": None}
    with ExitStack() as stack:
        reader = shards.open(stack)
        keys = reader.keys()
        _check_not_int4(config, keys)
        plan = plan_sources(keys, config, file)
        check_shapes(reader, plan, file)
        check_expert_forms(reader, plan, config, file)
        scales = read_scales(reader, plan, file)
        if dtype is None and scales and moe_weights == "dequantize":
            to["fallback"] = checkpoint_dtype(path)  # the dtype of the rest of the file
        _report_extra(plan.extra, file, strict)
        for name, src in plan.sources.items():
            if name in scales:
                continue  # placed with its experts
            tensor = _read(reader, src, file)
            if name in _experts(config):
                out.update(_place_experts(name, tensor, scales, moe_weights, to))
                continue
            if not tensor.is_floating_point():
                raise CheckpointError(
                    f"{file}: tensor {src.key!r} has non-float dtype {tensor.dtype}"
                )
            if plan.legacy and name in _TRANSPOSED_IN_LEGACY:
                tensor = tensor.T
            out[name] = tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()
    return out


def _experts(config: MoondreamConfig) -> frozenset[str]:
    t = config.text
    return frozenset(
        f"text.blocks.{i}.mlp.{fc}.weight"
        for i in range(t.n_layers)
        if t.is_moe_layer(i)
        for fc in ("fc1", "fc2")
    )


def load_kv_scales(path: str | Path, config: MoondreamConfig) -> tuple[KvScales, ...] | None:
    """Every layer's FP8 KV-cache scales (legacy ``text_model.transformer.h.N.kv_quantizer.
    {k_scale, v_scale}``, one value each) as float32, or None unless every layer has both:
    FP8 KV is offered only then. A scale that is not one positive finite value is refused."""
    shards = _weights_files(path)
    with ExitStack() as stack:
        reader = shards.open(stack)
        keys = set(reader.keys())
        names = [
            [f"text_model.transformer.h.{i}.kv_quantizer.{w}_scale" for w in ("k", "v")]
            for i in range(config.text.n_layers)
        ]
        if not all(k in keys for pair in names for k in pair):
            return None
        out = []
        for pair in names:
            values = [reader.tensor(k).float().reshape(-1) for k in pair]
            for key, t in zip(pair, values, strict=True):
                if t.numel() != 1 or not bool(torch.isfinite(t).all() and (t > 0).all()):
                    raise CheckpointError(
                        f"{shards.source}: KV scale {key!r} must be one positive finite value, "
                        f"got {t.tolist()[:4]}"
                    )
            out.append(KvScales(values[0].clone(), values[1].clone()))
    return tuple(out)


_MOE_KEY = re.compile(r"(\.mlp\.router\.|\.gate\.weight$|\.mlp\.experts\.weight$)")


def detect_family(path: str | Path) -> str:
    """``"moondream3"`` if the checkpoint's keys hold MoE routers or experts (either layout),
    else ``"moondream2"``; read from the safetensors header only."""
    header = _weights_files(path).header()
    return MOONDREAM3 if any(_MOE_KEY.search(k) for k in header) else MOONDREAM2


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The floating dtype of the checkpoint's tensors, read from the safetensors header only.

    With mixed float dtypes the one holding the most elements wins.
    """
    shards = _weights_files(path)
    counts: dict[torch.dtype, int] = {}
    for info in shards.header().values():
        if not isinstance(info, dict):
            continue
        dt = _SAFETENSORS_DTYPES.get(str(info.get("dtype")))
        if dt is not None:
            numel = 1
            for d in info.get("shape", ()):
                numel *= int(d)
            counts[dt] = counts.get(dt, 0) + numel
    if not counts:
        raise CheckpointError(f"{shards.source} holds no floating point tensors")
    return max(counts, key=counts.__getitem__)


def load_config(path: str | Path) -> MoondreamConfig:
    """The model config for a checkpoint: its directory's ``config.json`` ``"config"`` entry.

    ``path`` is a checkpoint directory, its ``model.safetensors`` (or shard index) or the
    ``config.json`` itself.
    When the directory has no config.json the production defaults are returned: the official
    ``vikhyatk/moondream2`` config.json carries ``"config": {}``, so the defaults are exactly what
    it describes. A small or custom checkpoint without its config.json then fails in
    :func:`load_state_dict` with a shape mismatch that names the tensor.
    """
    path = Path(path).expanduser()
    is_config = path.suffix == ".json" and path.name != INDEX_FILE
    if path.is_dir():
        cfg = path / CONFIG_FILE
    elif is_config:
        cfg = path
    else:
        cfg = path.parent / CONFIG_FILE
    if not cfg.is_file():
        if is_config or not path.exists():
            raise CheckpointError(f"no config at {cfg}")
        try:
            family = detect_family(path)
        except CheckpointError:  # unreadable: load_state_dict reports it with its own message
            family = MOONDREAM2
        return MoondreamConfig.from_dict({}, family=family)
    config = MoondreamConfig.from_json_file(cfg)
    weights = path if path.is_file() and not is_config else cfg.parent
    md3_tensors = _has_weights(weights) and detect_family(weights) == MOONDREAM3
    if config.family == MOONDREAM2 and md3_tensors:
        # production config.json files carry "config": {}; the tensors tell the family
        config = MoondreamConfig.from_json_file(cfg, family=MOONDREAM3)
    return config


def _has_weights(path: Path) -> bool:
    files = (WEIGHTS_FILE, INDEX_FILE, FP8_PT_FILE)
    return path.is_file() or any((path / f).is_file() for f in files)


def resolve_checkpoint(
    name_or_path: str | Path, revision: str | None = None, *, prefer_fp8: bool = False
) -> Path:
    """A local checkpoint path (directory or file) for a path or a Hugging Face repo id.

    Existing local paths are returned as given. Other ``owner/name`` strings are downloaded
    (one weights form -- ``model.safetensors`` if the repo has it, else the sharded set and its
    index, else ``model_fp8.pt`` -- plus config.json and tokenizer.json) with huggingface_hub,
    or taken from its cache when ``HF_HUB_OFFLINE=1``. ``prefer_fp8``: a repo that publishes
    ``model_fp8.pt`` beside a 16-bit form (``moondream/moondream3-preview``) gets the FP8 file,
    and the path returned is that file. Raises CheckpointError with instructions otherwise.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if isinstance(name_or_path, Path) or not looks_like_repo_id(str(name_or_path)):
        raise CheckpointError(
            f"no such checkpoint path: {path} (expected a directory holding {WEIGHTS_FILE} and "
            f"{CONFIG_FILE}, a {WEIGHTS_FILE} file, or a hub repo id like 'vikhyatk/moondream2')"
        )
    snapshot = download_checkpoint(
        str(name_or_path),
        revision=revision,
        what=f"{WEIGHTS_FILE} and {CONFIG_FILE} (or the shards and their {INDEX_FILE}, or "
        f"{FP8_PT_FILE})",
        prefer_fp8=prefer_fp8,
    )
    fp8_file = snapshot / FP8_PT_FILE
    return fp8_file if prefer_fp8 and fp8_file.is_file() else snapshot

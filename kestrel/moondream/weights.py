"""Moondream 2 / 3 checkpoint loading: a flat ``{native name: tensor}`` dict checked against
the config.

Native names are the module paths of the reference model without the Hugging Face wrapper's
``model.`` prefix (``vision.blocks.0.attn.qkv.weight``, ``text.wte``, ``region.coord_features``);
:func:`expected_shapes` lists all of them. Two on-disk layouts are read (architecture doc 7.1 and
7.2): the native HF layout of ``vikhyatk/moondream2`` and the older training layout
(``vision_encoder.…``, ``text_model.…``, ``region_model.…``), whose Fourier feature matrices are
stored transposed. ``._orig_mod`` (torch.compile wrappers) is dropped from every name.

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

from .config import MOONDREAM2, MOONDREAM3, MoondreamConfig
from .hub import CheckpointError, download_checkpoint, looks_like_repo_id
from .layout import _TRANSPOSED_IN_LEGACY, _legacy_name, expected_shapes
from .shards import INDEX_FILE, WEIGHTS_FILE, ShardReader, ShardSet

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "checkpoint_dtype",
    "detect_family",
    "expected_shapes",
    "load_config",
    "load_state_dict",
    "resolve_checkpoint",
]

CONFIG_FILE = "config.json"

_INT4_SUFFIXES = (".weight.packed", ".weight.scale", ".weight.zero_point")
_NATIVE_ROOTS = ("vision.", "text.", "region.")
_LEGACY_ROOTS = ("vision_encoder.", "text_model.", "region_model.")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class CheckpointWarning(UserWarning):
    """A checkpoint that loads but holds tensors Kestrel does not use."""


def _native_key(key: str) -> str:
    key = key.replace("._orig_mod", "")
    return key.removeprefix("model.")


FP8_FILE = "model_fp8.pt"
_FP8_MARKERS = (".moe_quant.", ".tau_wqwv")
_FP8_MESSAGE = (
    "Kestrel 0.9.2's FP8-expert Moondream 3 files ({what}) are not supported: how their experts "
    "dequantize is not pinned down by a public source. Supported: Moondream 2 and Moondream 3 "
    f"{WEIGHTS_FILE} checkpoints with 16- or 32-bit float experts, in the Hugging Face native "
    "layout (model.text.blocks.N.mlp.fc1.weight) or the legacy one "
    "(text_model.transformer.h.N.mlp.experts.weight)"
)


def _check_not_fp8(file: Path, keys: list[str] | None = None) -> None:
    if file.name == FP8_FILE or (file.is_dir() and (file / FP8_FILE).is_file()):
        raise CheckpointError(_FP8_MESSAGE.format(what=f"{FP8_FILE} at {file}"))
    marked = [k for k in keys or () if any(m in k for m in _FP8_MARKERS)]
    if marked:
        raise CheckpointError(_FP8_MESSAGE.format(what=f"{file} holds {marked[0]!r}"))


def _weights_files(path: str | Path) -> ShardSet:
    path = Path(path).expanduser()
    _check_not_fp8(path)
    return ShardSet.locate(path)


def _check_not_int4(config: MoondreamConfig, keys: list[str] | None = None) -> None:
    quantized = config.text.group_size is not None or config.region.group_size is not None
    packed = [k for k in keys or () if k.endswith(_INT4_SUFFIXES)]
    if quantized or packed:
        found = f" (found {packed[0]!r} and {len(packed) - 1} more)" if packed else ""
        raise CheckpointError(
            "int4 group_size checkpoints are not supported yet"
            f"{found}; use the unquantized 16-bit model.safetensors of the same release"
        )


def _source_map(keys: list[str], file: Path) -> tuple[dict[str, str], bool]:
    """Detect the layout and map (renamed) names to file keys: (name -> key, legacy?)."""
    stripped = {k: k.replace("._orig_mod", "") for k in keys}
    if any(_native_key(k).startswith(_NATIVE_ROOTS) for k in keys):
        legacy, rename = False, {k: _native_key(k) for k in keys}
    elif any(s.startswith(_LEGACY_ROOTS) for s in stripped.values()):
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


def _resolve_sources(
    keys: list[str], config: MoondreamConfig, file: Path
) -> tuple[dict[str, str], bool, list[str]]:
    """native name -> file key for every expected tensor, the layout, and the unused keys."""
    by_name, legacy = _source_map(keys, file)
    expected = expected_shapes(config)
    on_disk = {n: (_legacy_name(n, config) if legacy else n) for n in expected}
    sources = {n: by_name[d] for n, d in on_disk.items() if d in by_name}
    wanted = set(on_disk.values())
    extra = sorted(key for name, key in by_name.items() if name not in wanted)
    missing = [n for n in expected if n not in sources]
    if missing:
        shown = ", ".join(repr(on_disk[n]) for n in missing[:5])
        raise CheckpointError(
            f"{file} lacks {len(missing)} of the {len(expected)} tensors the config expects "
            f"({'legacy' if legacy else 'native'} layout), e.g. {shown}; is config.json the one "
            "that belongs to this checkpoint?"
        )
    return sources, legacy, extra


def _report_extra(extra: list[str], file: Path, strict: bool) -> None:
    if not extra:
        return
    msg = f"{file} holds {len(extra)} tensor(s) Kestrel does not use, e.g. {extra[:5]}"
    if strict:
        raise CheckpointError(msg + " (strict=True)")
    warnings.warn(msg + "; they are ignored", CheckpointWarning, stacklevel=3)


def _check_shapes(
    reader: ShardReader, sources: dict[str, str], expected: dict, legacy: bool, file: Path
) -> None:
    """Every source tensor has its expected shape (read from the headers only)."""
    for name, key in sources.items():
        shape = reader.shape(key)
        transposed = legacy and name in _TRANSPOSED_IN_LEGACY
        if transposed:
            shape = shape[::-1]
        if shape == expected[name]:
            continue
        if transposed:
            raise CheckpointError(
                f"{file}: legacy tensor {key!r} has shape {list(shape[::-1])} but the "
                f"legacy layout stores {name!r} as {list(expected[name][::-1])}, transposed"
            )
        raise CheckpointError(
            f"{file}: tensor {key!r} has shape {list(shape)} but the config expects "
            f"{list(expected[name])} for {name!r}; is config.json the one that belongs "
            "to this checkpoint?"
        )


def load_state_dict(
    path: str | Path,
    config: MoondreamConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    strict: bool = False,
) -> dict[str, torch.Tensor]:
    """Load every tensor of :func:`expected_shapes` from ``path``: a directory, its
    ``model.safetensors``, or the ``model.safetensors.index.json`` of a sharded set.

    ``dtype=None`` keeps the checkpoint's dtype. Unknown extra tensors are ignored with a
    :class:`CheckpointWarning` (``strict=True`` raises instead). Raises CheckpointError for a
    missing or unreadable file, an index that disagrees with its shards, an unrecognized layout,
    missing tensors, a shape mismatch, or an int4 quantized checkpoint. Shapes are checked from
    the headers before any tensor is read.
    """
    shards = _weights_files(path)
    file = shards.source
    _check_not_int4(config)
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        reader = shards.open(stack)
        keys = reader.keys()
        _check_not_int4(config, keys)
        _check_not_fp8(file, keys)
        sources, legacy, extra = _resolve_sources(keys, config, file)
        _check_shapes(reader, sources, expected_shapes(config), legacy, file)
        _report_extra(extra, file, strict)
        for name, key in sources.items():
            try:
                tensor = reader.tensor(key)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"cannot read tensor {key!r} from {file}: {exc}") from exc
            if not tensor.is_floating_point():
                raise CheckpointError(f"{file}: tensor {key!r} has non-float dtype {tensor.dtype}")
            if legacy and name in _TRANSPOSED_IN_LEGACY:
                tensor = tensor.T
            out[name] = tensor.to(device=device, dtype=dtype or tensor.dtype).contiguous()
    return out


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
    return path.is_file() or any((path / f).is_file() for f in (WEIGHTS_FILE, INDEX_FILE))


def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None) -> Path:
    """A local checkpoint path (directory or file) for a path or a Hugging Face repo id.

    Existing local paths are returned as given. Other ``owner/name`` strings are downloaded
    (only the weights -- ``model.safetensors`` if the repo has it, else the sharded set and its
    index -- config.json and tokenizer.json) with huggingface_hub, or taken from its cache when
    ``HF_HUB_OFFLINE=1``. Raises CheckpointError with instructions otherwise.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if isinstance(name_or_path, Path) or not looks_like_repo_id(str(name_or_path)):
        raise CheckpointError(
            f"no such checkpoint path: {path} (expected a directory holding {WEIGHTS_FILE} and "
            f"{CONFIG_FILE}, a {WEIGHTS_FILE} file, or a hub repo id like 'vikhyatk/moondream2')"
        )
    return download_checkpoint(
        str(name_or_path),
        revision=revision,
        what=f"{WEIGHTS_FILE} and {CONFIG_FILE} (or the shards and their {INDEX_FILE})",
    )

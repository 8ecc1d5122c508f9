"""The safetensors file(s) of a checkpoint: one ``model.safetensors`` or a sharded set.

A sharded checkpoint is the Hugging Face form: ``model.safetensors.index.json`` whose
``weight_map`` names, for every tensor, the shard file holding it (``model-00001-of-00002
.safetensors``...). :class:`ShardSet` reads such a set as one key space: headers are merged, each
key is read from its own shard, and the index is checked against the shards' headers (a key
absent from the shard the index names, or stored in two shards, is a :class:`CheckpointError`).
A directory holding both forms is read as the single file, as ``transformers`` does.

A ``.pt`` file (``model_fp8.pt``: a ``torch.save`` dict, the form Moondream 3 preview's FP8 file
is published in) is opened with ``torch.load(weights_only=True, mmap=True)``: the unpickler
builds nothing but tensors and plain containers, and the tensors stay memory-mapped. Anything
but a flat ``{str: Tensor}`` dict is refused. A directory holding a safetensors form and a
``.pt`` file is read as the safetensors form.
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .hub import CheckpointError

__all__ = [
    "FP8_PT_FILE",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "ShardReader",
    "ShardSet",
    "load_pt",
    "read_header",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP8_PT_FILE = "model_fp8.pt"

# torch dtype -> the safetensors header's name for it (what ``header()`` reports for a .pt)
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def load_pt(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.pt`` checkpoint, memory-mapped; a CheckpointError for a file that is
    not a flat ``{str: Tensor}`` dict or holds anything the safe unpickler refuses."""
    try:
        obj = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, OSError...: all mean "not ours"
        raise CheckpointError(
            f"cannot read {file} as a torch tensor dict ({type(exc).__name__}: "
            f"{str(exc)[:300]}); only plain tensor dicts are loaded, never other pickled objects"
        ) from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file} holds a {type(obj).__name__}, not a dict of tensors")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{file} is not a plain tensor dict: entry {key!r} is a {type(value).__name__}"
            )
    return obj


def read_header(file: Path) -> dict:
    """The safetensors header of ``file``: {key: {dtype, shape, data_offsets}} (no metadata)."""
    try:
        with file.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                raise ValueError(f"implausible header length {n}")
            header = json.loads(fh.read(n))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"cannot read the safetensors header of {file}: {exc}") from exc
    header.pop("__metadata__", None)
    return header


def _read_index(index: Path) -> dict[str, Path]:
    """tensor key -> shard path, from the index's ``weight_map``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
        out = {str(k): index.parent / str(v) for k, v in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read the shard index {index}: {exc}") from exc
    for shard in sorted(set(out.values())):
        if shard.parent != index.parent or not shard.is_file():
            raise CheckpointError(
                f"{index} names the shard {shard.name!r}, which is not a file next to it "
                "(an incomplete download?)"
            )
    return out


@dataclass(frozen=True, slots=True)
class ShardSet:
    """The file(s) of one checkpoint. ``source`` is what error messages name (the single file or
    the index); ``files`` the safetensors files, in order."""

    source: Path
    files: tuple[Path, ...]

    @classmethod
    def locate(cls, path: Path) -> ShardSet:
        """The checkpoint at ``path``: a directory, its ``model.safetensors``, or its index."""
        if path.is_dir():
            single, index, pt = path / WEIGHTS_FILE, path / INDEX_FILE, path / FP8_PT_FILE
            if single.is_file() or not (index.is_file() or pt.is_file()):
                path = single
            else:
                path = index if index.is_file() else pt
        if path.name.endswith(".index.json") and path.is_file():
            return cls(path, tuple(sorted(set(_read_index(path).values()))))
        if path.suffix == ".pt" and path.is_file():
            return cls(path, (path,))
        if not path.is_file():
            raise CheckpointError(
                f"no checkpoint at {path}: expected a {WEIGHTS_FILE} file, a sharded set with "
                f"its {INDEX_FILE}, or a directory holding either (with its config.json)"
            )
        return cls(path, (path,))

    @property
    def sharded(self) -> bool:
        return self.source not in self.files

    @property
    def pickled(self) -> bool:
        """A ``.pt`` file (read with :func:`load_pt`) rather than safetensors."""
        return self.source.suffix == ".pt"

    def header(self) -> dict:
        """The merged header of every file: {key: {dtype, shape[, data_offsets]}}."""
        if self.pickled:
            return {
                k: {"dtype": _DTYPE_NAMES.get(t.dtype, str(t.dtype)), "shape": list(t.shape)}
                for k, t in load_pt(self.source).items()
            }
        return {k: info for _, k, info in self._entries()}

    def key_files(self) -> dict[str, Path]:
        """key -> the file holding it, checked against the index when sharded."""
        out: dict[str, Path] = {}
        for file, key, _ in self._entries():
            if key in out:
                raise CheckpointError(
                    f"{self.source}: tensor {key!r} is stored in both {out[key].name} and "
                    f"{file.name}"
                )
            out[key] = file
        if self.sharded:
            for key, file in _read_index(self.source).items():
                if out.get(key) != file:
                    where = out[key].name if key in out else "no shard"
                    raise CheckpointError(
                        f"{self.source} maps {key!r} to {file.name}, but {where} holds it"
                    )
        return out

    def _entries(self):
        for file in self.files:
            for key, info in read_header(file).items():
                yield file, key, info

    def open(self, stack: ExitStack) -> ShardReader:
        """Open every file (closed with ``stack``) as one :class:`ShardReader`."""
        if self.pickled:
            return ShardReader({}, load_pt(self.source))
        key_files = self.key_files()
        handles = {}
        for file in self.files:
            try:
                handles[file] = stack.enter_context(
                    safe_open(str(file), framework="pt", device="cpu")
                )
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise CheckpointError(
                    f"cannot read {file} as safetensors ({exc}); the file is corrupt or "
                    "incomplete (re-download it)"
                ) from exc
        return ShardReader({k: handles[f] for k, f in key_files.items()})


@dataclass(frozen=True, slots=True)
class ShardReader:
    """Memory-mapped reads of a checkpoint's tensors by key, whichever file holds them:
    safetensors ``handles`` by key, or the (memory-mapped) ``tensors`` of a ``.pt`` file."""

    handles: dict
    tensors: dict | None = None

    def keys(self) -> list[str]:
        return list(self.tensors if self.tensors is not None else self.handles)

    def shape(self, key: str) -> tuple[int, ...]:
        if self.tensors is not None:
            return tuple(self.tensors[key].shape)
        return tuple(self.handles[key].get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """The stored dtype in safetensors' spelling (``F32``, ``BF16``, ``F8_E4M3``, ``U8``)."""
        if self.tensors is not None:
            dt = self.tensors[key].dtype
            return _DTYPE_NAMES.get(dt, str(dt))
        return str(self.handles[key].get_slice(key).get_dtype())

    def tensor(self, key: str) -> torch.Tensor:
        if self.tensors is not None:
            return self.tensors[key]
        return self.handles[key].get_tensor(key)

"""The engine's loaded LoRA adapters: names -> adapters, bounded in number.

An adapter's cache identity is ``name@<first 16 hex of sha256 over its tensors>``, so loading
the same name with other weights gives a new identity and stale KV is never reused (the old
entries age out through LRU eviction). Requests hold the adapter object itself: unloading (or
replacing) a name lets the requests that already use it finish, while new requests for an
unloaded name fail with :class:`~kestrel.errors.UnknownAdapterError`.

Memory is bounded by a maximum number of loaded adapters. Loading one more is refused with a
:class:`~kestrel.errors.CapacityError` rather than silently unloading another: which adapter
may go is the operator's decision, and an adapter that vanished under its users' feet would
turn into errors far from the cause.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kestrel.errors import CapacityError, InvalidInputError, ModelLoadError, UnknownAdapterError
from kestrel.moondream.lora import LoraAdapter, load_adapter
from kestrel.moondream.model import MoondreamModel

__all__ = ["DEFAULT_MAX_ADAPTERS", "AdapterRegistry"]

DEFAULT_MAX_ADAPTERS = 8


class AdapterRegistry:
    def __init__(self, model: MoondreamModel, max_adapters: int = DEFAULT_MAX_ADAPTERS) -> None:
        if isinstance(max_adapters, bool) or not isinstance(max_adapters, int):
            raise InvalidInputError(f"max_adapters must be an int, got {max_adapters!r}")
        if max_adapters < 0:
            raise InvalidInputError(f"max_adapters must be >= 0, got {max_adapters}")
        self.model = model
        self.max_adapters = max_adapters
        self._by_name: dict[str, LoraAdapter] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load (or replace) ``name``; returns the adapter (its ``lora_id`` is the cache id)."""
        adapter = read_adapter(name, path, self.model)  # outside the lock: reads a file
        with self._lock:
            if name not in self._by_name and len(self._by_name) >= self.max_adapters:
                raise CapacityError(
                    f"{len(self._by_name)} adapters are loaded, the maximum (max_adapters="
                    f"{self.max_adapters}); unload one first"
                )
            self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise UnknownAdapterError(f"no adapter named {name!r} is loaded")

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def get(self, name: str | None) -> LoraAdapter | None:
        if name is None:
            return None
        if not isinstance(name, str):
            raise InvalidInputError(f"adapter must be a name (str), got {type(name).__name__}")
        with self._lock:
            found = self._by_name.get(name)
        if found is None:
            loaded = ", ".join(self.names()) or "none"
            raise UnknownAdapterError(f"no adapter named {name!r} is loaded (loaded: {loaded})")
        return found


def read_adapter(name: str, path: str | Path, model: MoondreamModel) -> LoraAdapter:
    if not isinstance(name, str) or not name or "@" in name:
        raise InvalidInputError(f"adapter name must be a non-empty string without '@': {name!r}")
    try:
        return load_adapter(path, model.config, name=name, device=model.device, dtype=model.dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load adapter {name!r} from {path}: {exc}") from exc

"""Per-request generation settings: the user's dict, validated once into a frozen value.

Defaults are the reference implementation's, per model family, so answers compare with what
users get from it: Moondream 2 temperature 0.5, top_p 0.3, 768 tokens, 50 objects; Moondream 3
top_p 0.9 and 150 objects (:func:`family_settings`). Temperature 0 is greedy; point and
detect are always greedy. A ``seed`` gives the request its own random generator, so a sampled
answer is reproducible whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kestrel.errors import InvalidInputError

__all__ = ["DEFAULT_SETTINGS", "Settings", "family_settings", "parse_settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    temperature: float = 0.5
    top_p: float = 0.3
    max_tokens: int = 768
    max_objects: int = 50
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


DEFAULT_SETTINGS = Settings()
# Moondream 3's reference (moondream.py) samples with top_p 0.9 and finds up to 150 objects.
_FAMILY_SETTINGS = {"moondream3": Settings(top_p=0.9, max_objects=150)}


def family_settings(family: str) -> Settings:
    """The default settings of a model family (``MoondreamConfig.family``)."""
    return _FAMILY_SETTINGS.get(family, DEFAULT_SETTINGS)


_KEYS = tuple(f.name for f in fields(Settings))
_MAX_SEED = 2**63 - 1


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"settings['{key}'] must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidInputError(f"settings['{key}'] must be finite, got {value!r}")
    return value


def _integer(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"settings['{key}'] must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidInputError(f"settings['{key}'] must be in [{low}, {high}], got {value}")
    return int(value)


def parse_settings(
    raw: Mapping[str, Any] | Settings | None, defaults: Settings = DEFAULT_SETTINGS
) -> Settings:
    """Validate a settings dict (None = ``defaults``; absent keys take theirs). Unknown keys
    and bad values raise :class:`~kestrel.errors.InvalidInputError` naming the key."""
    if raw is None:
        return defaults
    if isinstance(raw, Settings):
        return raw
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"settings must be a dict, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise InvalidInputError(f"unknown settings key(s) {unknown}; allowed: {', '.join(_KEYS)}")
    out: dict[str, Any] = {}
    if raw.get("temperature") is not None:
        t = _number("temperature", raw["temperature"])
        if t < 0:
            raise InvalidInputError(f"settings['temperature'] must be >= 0, got {t}")
        out["temperature"] = t
    if raw.get("top_p") is not None:
        p = _number("top_p", raw["top_p"])
        if not 0.0 < p <= 1.0:
            raise InvalidInputError(f"settings['top_p'] must be in (0, 1], got {p}")
        out["top_p"] = p
    if raw.get("max_tokens") is not None:
        out["max_tokens"] = _integer("max_tokens", raw["max_tokens"], 1, 1 << 20)
    if raw.get("max_objects") is not None:
        out["max_objects"] = _integer("max_objects", raw["max_objects"], 1, 1 << 16)
    if raw.get("seed") is not None:
        out["seed"] = _integer("seed", raw["seed"], 0, _MAX_SEED)
    return replace(defaults, **out)

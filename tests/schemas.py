"""JSON schemas made from a seed, for the structured-answer tests: nested objects, arrays,
enums, bounded numbers, required and optional fields. Every string, array and number is
bounded, so an answer that follows the schema ends within a modest token budget."""

from __future__ import annotations

import random
from typing import Any

__all__ = ["schemas"]

WORDS = ("colour", "count", "shape", "size", "label", "kind", "score", "tags", "box", "seen")
ENUMS = (["red", "green", "blue"], ["circle", "square"], ["yes", "no"], ["small", "large"])


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("enum", "integer", "number", "string", "boolean", "null_or"))
    if kind == "enum":
        return {"type": "string", "enum": list(rng.choice(ENUMS))}
    if kind == "integer":
        low = rng.randint(-5, 5)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 20)}
    if kind == "number":
        top = rng.choice((1, 10, 100))
        return {
            "type": "number",
            "minimum": 0,
            "maximum": top,
            "multipleOf": rng.choice((0.5, 0.25, 0.125)),
        }
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"type": ["string", "null"], "enum": [*rng.choice(ENUMS), None]}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.2:
        return _object(rng, depth + 1)
    if depth < 2 and roll < 0.35:
        return {"type": "array", "items": _leaf(rng), "maxItems": rng.randint(1, 3)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def schemas(n: int, seed: int = 51) -> list[dict[str, Any]]:
    """``n`` object schemas, the same ones for the same seed."""
    rng = random.Random(seed)
    return [_object(rng) for _ in range(n)]

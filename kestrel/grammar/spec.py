"""A call's ``response_format``, read and checked: what shape its answer must take.

Accepted (the OpenAI shapes, then Kestrel's own two):

- ``{"type": "text"}`` or None: free text;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name"?, "schema", "strict"?, "description"?}}``
  (``strict`` is accepted either way: the grammar always holds the answer to the schema);
- ``{"type": "regex", "regex": PATTERN}``: text matching the whole pattern;
- ``{"type": "choice", "choices": [STRING, ...]}``: exactly one of the strings;
- from Python, a Pydantic model class too (its ``model_json_schema()``).

``GrammarSpec.key`` is the spec's compact text (its keys in their order: an answer's properties
come in the order its schema lists them), which compiled grammars are cached by;
``GrammarSpec.parse`` turns an answer into its value (the JSON value, or the text itself).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kestrel.errors import InvalidInputError

__all__ = ["KINDS", "MAX_CHOICES", "GrammarSpec", "parse_response_format"]

KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_CHOICES = 1024
MAX_SOURCE_CHARS = 1 << 20


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One answer shape: ``kind`` (one of ``KINDS``) and its ``source`` (the schema as
    canonical JSON, the pattern, or the choices as a JSON list)."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.source}"

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_object", "json_schema")

    def parse(self, text: str) -> Any:
        """The answer's value: the JSON value for a JSON kind (None when ``text`` is not JSON,
        e.g. an answer cut at ``max_tokens``), else the text itself."""
        if not self.is_json:
            return text
        try:
            return json.loads(text)
        except ValueError:
            return None


def _invalid(message: str) -> InvalidInputError:
    return InvalidInputError(f"response_format: {message}")


def _canonical(value: Any) -> str:
    try:
        # key order kept: a schema's properties come out in the order it lists them
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _invalid(f"the schema is not JSON ({exc})") from None
    if len(text) > MAX_SOURCE_CHARS:
        raise _invalid(f"the schema is over {MAX_SOURCE_CHARS} characters")
    return text


def _json_schema(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise _invalid("'json_schema' must be an object {'name', 'schema', 'strict'?}")
    unknown = sorted(set(value) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _invalid(f"unknown json_schema field(s) {unknown}")
    schema = value.get("schema")
    if schema is None:
        schema = {"type": "object"}  # OpenAI: a missing schema is any object
    if not isinstance(schema, dict):
        raise _invalid("'json_schema.schema' must be a JSON schema object")
    return GrammarSpec("json_schema", _canonical(schema))


def _choices(value: Any) -> GrammarSpec:
    if not isinstance(value, list) or not value:
        raise _invalid("'choices' must be a non-empty list of strings")
    if len(value) > MAX_CHOICES or not all(isinstance(c, str) and c for c in value):
        raise _invalid(f"'choices' must be 1 to {MAX_CHOICES} non-empty strings")
    return GrammarSpec("choice", _canonical(list(dict.fromkeys(value))))


def parse_response_format(value: Any) -> GrammarSpec | None:
    """The spec of a ``response_format`` (module doc); None for free text. Raises
    InvalidInputError naming what is wrong."""
    if value is None:
        return None
    schema_of = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(schema_of):  # a Pydantic model class
        return GrammarSpec("json_schema", _canonical(schema_of()))
    if not isinstance(value, dict):
        raise _invalid(f"must be an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    fields = {"text": set(), "json_object": set(), "json_schema": {"json_schema"},
              "regex": {"regex"}, "choice": {"choices"}}  # fmt: skip
    if kind not in fields:
        raise _invalid(f"'type' must be one of {sorted(fields)}, got {kind!r}")
    unknown = sorted(set(value) - {"type"} - fields[kind])
    if unknown:
        raise _invalid(f"unknown field(s) {unknown} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", _canonical({"type": "object"}))
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    if kind == "choice":
        return _choices(value.get("choices"))
    pattern = value.get("regex")
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_SOURCE_CHARS:
        raise _invalid("'regex' must be a non-empty pattern string")
    return GrammarSpec("regex", pattern)

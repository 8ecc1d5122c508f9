"""Request bodies of the moondream protocol -> validated engine calls (no web framework here).

The ``moondream`` client (2.6) posts JSON objects: ``/query`` ``{"question", "image_url"?,
"stream", "settings"?, "reasoning"?, "spatial_refs"?}``, ``/caption`` ``{"image_url", "length",
"stream", "settings"?}``, ``/point`` and ``/detect`` ``{"image_url", "object", "settings"?}``
(point may add ``"spatial_refs"``), ``/segment`` ``{"image_url", "object", "stream",
"spatial_refs"?, "settings"?}``, each maybe with ``"model"`` (accepted, ignored: one model is
served, unless it names ``<model>@<adapter>``). Kestrel adds ``"adapter"``; ``"variant"`` (the
Node client's name for a finetune) means the same. Moondream Station's ``"obj"`` is accepted
for ``"object"``. ``image_url`` is a ``data:image/...;base64,`` URL or bare base64; remote URLs
are refused (the server never fetches on a client's behalf). A JSON ``null`` is "not set".

:func:`parse_call` runs in a worker thread: JSON parsing, base64 and image decoding all cost
CPU time proportional to the upload and must not stall the event loop. Field shapes are
checked here; values (settings ranges, lengths, coordinates) are the engine's to check.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kestrel.errors import InvalidInputError
from kestrel.images import PreparedImage
from kestrel.server.errors import ApiError

__all__ = ["SKILLS", "Call", "Prepare", "decode_data_url", "load_object", "parse_call", "typed"]

Prepare = Callable[[bytes], PreparedImage]  # encoded bytes -> a prepared image (or refused)

SKILLS = ("query", "caption", "point", "detect")
_COMMON = frozenset(
    {"image_url", "settings", "adapter", "variant", "cache_salt", "model", "stream"}
)
_FIELDS: dict[str, frozenset[str]] = {
    "query": _COMMON | {"question", "reasoning", "spatial_refs"},
    "caption": _COMMON | {"length"},
    "point": _COMMON | {"object", "obj", "spatial_refs"},
    "detect": _COMMON | {"object", "obj"},
    "segment": _COMMON | {"object", "obj", "spatial_refs"},
}
_REQUIRED = {"query": ("question",), "caption": ("image_url",), "point": ("image_url", "object")}
_REQUIRED["detect"] = _REQUIRED["segment"] = _REQUIRED["point"]
_STREAMS = frozenset({"query", "caption", "segment"})
_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)
_BARE_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+=*\s*", re.ASCII)


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """One validated request: which skill, its image (decoded and hashed) and its arguments.
    ``text`` is the question (query) or the object (point, detect)."""

    skill: str
    model: str | None
    image: PreparedImage | None
    text: str | None
    settings: dict[str, Any] | None
    adapter: str | None
    stream: bool
    reasoning: bool
    cache_salt: str | None
    length: str
    spatial_refs: tuple[tuple[float, ...], ...] | None


def _invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request", message)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise ApiError(400, "invalid_json", "the request body is empty; send a JSON object")
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "invalid_json", "the JSON body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, not {_kind(obj)}")
    return obj


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def typed(obj: Mapping[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    """``obj[key]`` (None when absent or null), which must be one of ``types``."""
    value = obj.get(key)
    bad_bool = isinstance(value, bool) and bool not in types
    if value is not None and (bad_bool or not isinstance(value, types)):
        raise _invalid(f"'{key}' must be {what}, got {_kind(value)}")
    return value


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:image/<type>;base64,<data>`` URL, or of bare base64 data (what
    Moondream Station also takes)."""
    match = _DATA_URL.match(url)
    if match is None and _BARE_BASE64.fullmatch(url[:4096]) and len(url) >= 16:
        return _b64(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else ""
        hint = " (remote URLs are not fetched)" if scheme.lower() in ("http", "https") else ""
        raise ApiError(
            400, "invalid_image", f"image_url must be a data:image/...;base64, URL{hint}"
        )
    return _b64(url[match.end() :])


def _b64(text: str) -> bytes:
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_image", "image_url holds invalid base64 data") from None
    if not data:
        raise ApiError(400, "invalid_image", "image_url holds no image data")
    return data


def _image(obj: Mapping[str, Any], prepare: Prepare) -> PreparedImage | None:
    url = typed(obj, "image_url", (str,), "a data URL or base64 string")
    if url is None:
        return None
    try:
        return prepare(decode_data_url(url))
    except InvalidInputError as exc:  # not an image, corrupt, or over the pixel limit
        raise ApiError(400, "invalid_image", str(exc)) from None


def _spatial_refs(obj: Mapping[str, Any]) -> tuple[tuple[float, ...], ...] | None:
    refs = typed(obj, "spatial_refs", (list,), "a list of [x, y] or [x0, y0, x1, y1] lists")
    if not refs:
        return None
    out = []
    for ref in refs:
        ok = isinstance(ref, list) and len(ref) in (2, 4)
        if not ok or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in ref):
            raise _invalid(f"each spatial ref must be [x, y] or [x0, y0, x1, y1], got {ref!r:.80}")
        out.append(tuple(float(v) for v in ref))
    return tuple(out)


def _aliased(skill: str, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` checked for unknown fields, with ``obj`` (Station's spelling) as ``object``."""
    unknown = sorted(set(obj) - _FIELDS[skill])
    if unknown:
        allowed = ", ".join(sorted(_FIELDS[skill] - {"obj"}))
        raise _invalid(f"unknown field(s) {unknown} for /{skill}; allowed: {allowed}")
    alias = obj.pop("obj", None)
    if alias is not None:
        if obj.get("object") is not None and obj["object"] != alias:
            raise _invalid("'obj' and 'object' disagree; send one")
        obj["object"] = alias
    return obj


def _adapter(obj: Mapping[str, Any]) -> str | None:
    """``adapter``, or ``variant`` (the same thing by the Node client's name)."""
    adapter = typed(obj, "adapter", (str,), "a string")
    variant = typed(obj, "variant", (str,), "a string")
    if adapter is not None and variant is not None and adapter != variant:
        raise _invalid("'adapter' and 'variant' name different adapters; send one")
    return adapter if adapter is not None else variant


def parse_call(skill: str, body: bytes, *, prepare: Prepare) -> Call:
    """Validate the body of a ``POST /v1/<skill>``; raises :class:`ApiError` (400). The image
    is prepared by ``prepare`` (the app's ``KnownImages.prepare``: its pixel limit and EXIF
    option, and an image seen before is not decoded again)."""
    obj = _aliased(skill, load_object(body))
    for key in _REQUIRED[skill]:
        if obj.get(key) is None:
            raise _invalid(f"'{key}' is required for /{skill}")
    text_key = "question" if skill == "query" else "object"
    stream = bool(typed(obj, "stream", (bool,), "true or false"))
    if stream and skill not in _STREAMS:
        raise _invalid(f'/{skill} does not stream; send "stream": false or leave it out')
    refs = _spatial_refs(obj)
    if refs is not None and skill == "point":
        raise _invalid("spatial_refs is not supported for /point by this server")
    return Call(
        skill=skill,
        model=typed(obj, "model", (str,), "a string"),
        text=typed(obj, text_key, (str,), "a string") if skill != "caption" else None,
        settings=typed(obj, "settings", (dict,), "an object"),
        adapter=_adapter(obj),
        cache_salt=typed(obj, "cache_salt", (str,), "a string"),
        stream=stream,
        reasoning=bool(typed(obj, "reasoning", (bool,), "true or false")),
        length=typed(obj, "length", (str,), "a string") or "normal",
        spatial_refs=refs,
        image=_image(obj, prepare),  # last: the costly part, once the rest is known good
    )

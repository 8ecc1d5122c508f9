"""The rows of a Ray batch job: the reading side (one row per image, hashed once, then one row
per request with its routing key) and the output rows (``kestrel batch``'s records as Arrow).

Routing key: the image's content digest (SHA-256 of its decoded pixels, the same identity the
prefix cache uses, so two files holding the same pixels meet on one replica). A request without
an image is keyed by its own id (nothing to share, so it may go anywhere); an image that cannot
be read is keyed by its path, and the replica that gets its rows writes their error lines.
Nothing here needs Ray: the functions take and return Arrow tables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pyarrow as pa

from kestrel.batch.requests import BatchRequest
from kestrel.errors import KestrelError
from kestrel.images import prepare_image
from kestrel.results import RequestMetrics

__all__ = [
    "OUTPUT_SCHEMA",
    "PARSED_SCHEMA",
    "REQUEST_SCHEMA",
    "image_items",
    "keyed_requests",
    "record_of",
    "request_of",
    "table_of_records",
]

# One row per request, as the replicas get them.
REQUEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("image", pa.string()),  # the name written to the output (null: text only)
        ("path", pa.string()),  # the file to open (null: text only)
        ("question", pa.string()),
        ("adapter", pa.string()),
        ("key", pa.string()),  # the routing key
    ]
)
_ARROW_TYPES = {"float": pa.float64(), "int": pa.int64(), "str": pa.string()}
_METRICS = pa.struct(
    [(f.name, _ARROW_TYPES[getattr(f.type, "__name__", f.type)]) for f in fields(RequestMetrics)]
)
# One row per answered or failed request: kestrel batch's record, plus the serving replica.
OUTPUT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("image", pa.string()),
        ("question", pa.string()),
        ("adapter", pa.string()),
        ("answer", pa.string()),
        ("finish_reason", pa.string()),
        ("metrics", _METRICS),
        ("error", pa.string()),
        ("error_type", pa.string()),
        ("replica", pa.string()),
    ]
)
# A job under a JSON schema adds ``parsed`` after ``answer``: the value as JSON text (Parquet
# needs one type for a column; the JSONL lines carry the value itself, as kestrel batch's do).
PARSED_SCHEMA = OUTPUT_SCHEMA.insert(
    OUTPUT_SCHEMA.get_field_index("answer") + 1, pa.field("parsed", pa.string())
)
_KEEP_NULL = frozenset({"image", "parsed"})  # written as null, as kestrel batch does


def image_items(requests: Sequence[BatchRequest]) -> list[dict[str, Any]]:
    """One item per image file (in order of first appearance) holding all its requests, so the
    reading side decodes and hashes each image once; text-only requests are one item each."""
    items: dict[tuple[str, str], list[BatchRequest]] = {}
    for r in requests:
        items.setdefault(("text", r.id) if r.path is None else ("image", str(r.path)), []).append(r)
    return [
        {
            "path": None if group[0].path is None else str(group[0].path),
            "requests": json.dumps([[r.id, r.image, r.question, r.adapter] for r in group]),
        }
        for group in items.values()
    ]


def keyed_requests(items: pa.Table) -> pa.Table:
    """The reading side's map: decode and hash each item's image once, then emit one row per
    request with the routing key (a ``map_batches`` function, Arrow in and out)."""
    rows = []
    for item in items.to_pylist():
        path, requests = item["path"], json.loads(item["requests"])
        key = _key(path, requests[0][0])  # a text-only item holds one request
        rows.extend(
            {"id": rid, "image": image, "path": path, "question": question, "adapter": adapter,
             "key": key}
            for rid, image, question, adapter in requests
        )  # fmt: skip
    return pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)


def _key(path: str | None, rid: str) -> str:
    if path is None:
        return "text:" + rid
    try:
        return prepare_image(path).digest.hex()
    except KestrelError:  # unreadable: the replica reports it on each of the image's rows
        return "unreadable:" + path


def request_of(row: dict[str, Any]) -> BatchRequest:
    path = row["path"]
    return BatchRequest(
        row["id"], row["image"], None if path is None else Path(path), row["question"],
        row["adapter"],
    )  # fmt: skip


def table_of_records(records: list[dict[str, Any]], parsed: bool = False) -> pa.Table:
    """``kestrel batch`` records (with ``replica``) as Arrow rows; absent fields are null.
    ``parsed``: the job has a JSON schema (its lines' values become JSON text)."""
    if not parsed:
        return pa.Table.from_pylist(records, schema=OUTPUT_SCHEMA)
    texts = [{**r, "parsed": None if r.get("parsed") is None else json.dumps(r["parsed"])}
             if "answer" in r else r for r in records]  # fmt: skip
    return pa.Table.from_pylist(texts, schema=PARSED_SCHEMA)


def record_of(row: dict[str, Any]) -> dict[str, Any]:
    """An output row back to its ``kestrel batch`` record: the same keys in the same order
    (``adapter`` only when set; ``answer``, ``parsed`` under a schema, ``finish_reason``,
    ``metrics`` or ``error``, ``error_type``), then ``replica``."""
    out = {k: v for k, v in row.items() if v is not None or k in _KEEP_NULL}
    if "parsed" in out:
        if row.get("answer") is None:  # an error line: kestrel batch writes no "parsed"
            del out["parsed"]
        elif out["parsed"] is not None:
            out["parsed"] = json.loads(out["parsed"])
    return out

"""The output file of batch image-QA: one JSON line per request, appended; resume support.

An answered request is ``{"id", "image", "question", ["adapter",] "answer", ["parsed",]
"finish_reason", "metrics"}`` (``parsed``: with a job's ``response_format``, the answer's
value); a failed one ``{"id", "image", "question", ["adapter",] "error", "error_type"}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kestrel.batch.requests import BatchRequest
    from kestrel.results import QueryResult

__all__ = ["completed_ids", "error_record", "open_for_append", "result_record"]

_TAIL_BYTES = 1 << 20  # how far back from the end of the output a partial line is looked for


def _head(request: BatchRequest) -> dict[str, Any]:
    head = {"id": request.id, "image": request.image, "question": request.question}
    if request.adapter is not None:
        head["adapter"] = request.adapter
    return head


def result_record(
    request: BatchRequest, result: QueryResult, *, parsed: bool = False
) -> dict[str, Any]:
    shaped = {"parsed": result.parsed} if parsed else {}
    return {
        **_head(request),
        "answer": result.answer,
        **shaped,
        "finish_reason": result.finish_reason,
        "metrics": result.metrics.to_dict(),
    }


def error_record(request: BatchRequest, exc: BaseException) -> dict[str, Any]:
    return {
        **_head(request),
        "error": " ".join(str(exc).split()) or type(exc).__name__,
        "error_type": type(exc).__name__,
    }


def completed_ids(out: str | Path) -> set[str]:
    """The ids of the complete lines already in ``out`` (none if it does not exist)."""
    path = Path(out)
    if not path.exists():
        return set()
    done = set()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: its request runs again
            if isinstance(obj, dict) and "id" in obj:
                done.add(str(obj["id"]))
    return done


def open_for_append(path: Path):
    """Append mode, after repairing the end of the file: a run killed mid-write may have left
    a partial last line; it is dropped (its request runs again) so no line is glued to it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        end = f.seek(0, 2)
        f.seek(max(0, end - _TAIL_BYTES))
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            start = tail.rfind(b"\n") + 1
            try:  # a complete record that only lacks its newline is kept
                json.loads(tail[start:])
                f.write(b"\n")
            except ValueError:
                f.truncate(end - len(tail) + start)
    return path.open("a", encoding="utf-8")

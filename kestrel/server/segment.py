"""``POST /v1/segment``: the official clients' segment call (an object's box and outline).

The request is ``{"image_url", "object", "stream"?, "spatial_refs"?, "settings"?}`` (parsed
by :func:`kestrel.server.payloads.parse_call`). The blocking answer is ``{"path", "bbox",
"finish_reason", "request_id", "metrics"}``; the stream is server-sent events: ``{"type":
"bbox", "bbox"}`` once the box is decoded, ``{"type": "path_delta", "chunk", "completed":
false}`` per piece of path, then ``{"type": "final", "path", "bbox", "completed": true, ...}``.
The path is SVG path data relative to the box (:mod:`kestrel.skills.segment`).

An engine runs segment through ``asegment`` (same arguments as ``adetect`` plus
``spatial_refs`` and ``stream``; its stream yields the box as a dict, then path text). An engine
without it, or a model without segmentation, gets a 501 that says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from kestrel.results import RequestMetrics
from kestrel.server.errors import ApiError
from kestrel.server.responses import EventStream

__all__ = ["SegmentEventStream", "segment_body", "segment_response", "start_segment"]

Finish = Callable[[int, "RequestMetrics | None"], None]


def unsupported(engine: Any) -> ApiError:
    """The 501 for a server whose model cannot segment, naming why."""
    family = getattr(getattr(engine, "config", None), "family", None)
    if family == "moondream2":
        why = "segment is not supported by this model: Moondream 2 has no segmentation skill"
    else:
        why = (
            "segment needs a checkpoint with segmentation weights, and this one has none: the "
            "published Moondream 3 checkpoints stop after the box (their segmentation weights "
            "are not public)"
        )
    return ApiError(501, "unsupported", f"{why}; /v1/detect gives the object's box")


def start_segment(engine: Any, call: Any) -> Any:
    """The engine coroutine of a validated segment call; raises the 501 when it cannot run."""
    run = getattr(engine, "asegment", None)
    if run is None:
        raise unsupported(engine)
    refs = None if call.spatial_refs is None else [list(r) for r in call.spatial_refs]
    return run(
        call.image, call.text, spatial_refs=refs, settings=call.settings, adapter=call.adapter,
        cache_salt=call.cache_salt, stream=call.stream,
    )  # fmt: skip


def segment_body(result: Any, request_id: str) -> dict[str, Any]:
    return {
        "path": result.path,
        "bbox": result.bbox,
        "finish_reason": result.finish_reason,
        "request_id": request_id,
        "metrics": result.metrics.to_dict(),
    }


class SegmentEventStream(EventStream):
    """The segment events; the engine stream's deltas are the box (a dict), then path text."""

    def delta_event(self, delta: Any) -> dict[str, Any]:
        if isinstance(delta, dict):
            return {"type": "bbox", "bbox": delta}
        return {"type": "path_delta", "chunk": delta, "completed": False}

    def final_events(self, result: Any) -> list[dict[str, Any]]:
        return [{"type": "final", "completed": True, **segment_body(result, self.request_id)}]


def segment_response(call: Any, outcome: Any, *, request_id: str, finish: Finish) -> Response:
    if call.stream:
        return SegmentEventStream(outcome, skill="segment", request_id=request_id, finish=finish)
    finish(200, outcome.metrics)
    body = segment_body(outcome, request_id)
    return JSONResponse(body, headers={"X-Request-ID": request_id})

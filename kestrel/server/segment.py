"""``POST /v1/segment``: the official clients' segment call (an object's box and outline).

The request is ``{"image_url", "object", "stream"?, "spatial_refs"?, "settings"?}`` (parsed
by :func:`kestrel.server.payloads.parse_call`). The blocking answer is ``{"path", "bbox",
"finish_reason", "request_id", "metrics"}``; the stream is server-sent events: ``{"type":
"bbox", "bbox"}`` once the box is decoded, ``{"type": "path_delta", "chunk", "completed":
false}`` per piece of path, then ``{"type": "final", "path", "bbox", "completed": true, ...}``.
The path is SVG path data relative to the box (:mod:`kestrel.skills.segment`).

The engine runs segment through ``asegment`` (same arguments as ``adetect`` plus
``spatial_refs`` and ``stream``; its stream yields the box as a dict, then path text). A model
that cannot segment raises :class:`~kestrel.errors.UnsupportedError` naming why (a 501), from
``Engine`` and from the cluster's front door alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from kestrel.results import RequestMetrics
from kestrel.server.protocol import ServedEngine, call_options
from kestrel.server.responses import EventStream

__all__ = ["SegmentEventStream", "segment_body", "segment_response", "start_segment"]

Finish = Callable[[int, "RequestMetrics | None"], None]


def start_segment(engine: ServedEngine, call: Any) -> Any:
    """The engine coroutine of a validated segment call."""
    refs = None if call.spatial_refs is None else [list(r) for r in call.spatial_refs]
    return engine.asegment(
        call.image, call.text, spatial_refs=refs, stream=call.stream, **call_options(call)
    )


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

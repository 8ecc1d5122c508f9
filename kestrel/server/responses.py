"""Response bodies, server-sent event streams, and noticing a client that left.

A blocking call answers one JSON object: the skill's fields (``answer`` / ``caption`` /
``points`` / ``objects``, the last two with their ``count``), ``finish_reason``,
``request_id`` and ``metrics``. A streaming call answers ``text/event-stream``: one
``data: {"chunk": "..."}`` event per text delta, then ``data: {"completed": true, ...}`` with
the same fields less the text. An engine failure after
the stream started is a last ``data: {"error": {...}}`` event (its status is already sent).

The server (uvicorn) drops writes to a closed connection silently, so a client that leaves is
noticed by listening for ``http.disconnect`` while the engine works; the request is then
cancelled, which frees its KV pages at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from kestrel.errors import KestrelError
from kestrel.results import RequestMetrics
from kestrel.server.errors import CLIENT_CLOSED, ApiError, error_body, from_exception

__all__ = [
    "ClientGone",
    "EventStream",
    "error_response",
    "result_body",
    "until_disconnected",
]

Finish = Callable[[int, "RequestMetrics | None"], None]
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies: do not buffer the stream
]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the request was cancelled."""


def _fields(skill: str, result: Any) -> dict[str, Any]:
    if skill == "query":
        out: dict[str, Any] = {"answer": result.answer}
        if result.reasoning is not None:
            out["reasoning"] = result.reasoning.to_dict()
        return out
    if skill == "caption":
        return {"caption": result.caption}
    if skill == "point":  # "count": what Moondream Station adds
        return {"points": [dict(p) for p in result.points], "count": len(result.points)}
    return {"objects": [dict(o) for o in result.objects], "count": len(result.objects)}


def result_body(skill: str, result: Any, request_id: str, *, text: bool = True) -> dict:
    """The JSON body of a finished request; ``text=False`` leaves out the streamed text."""
    body = _fields(skill, result) if text else {}
    if not text and skill == "query" and result.reasoning is not None:
        body["reasoning"] = result.reasoning.to_dict()
    body.update(
        finish_reason=result.finish_reason,
        request_id=request_id,
        metrics=result.metrics.to_dict(),
    )
    return body


def error_response(err: ApiError, request_id: str) -> JSONResponse:
    headers = {**err.headers, "X-Request-ID": request_id}
    return JSONResponse(error_body(err, request_id), status_code=err.status, headers=headers)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _cancel(value: Any) -> None:
    cancel = getattr(value, "cancel", None)
    if cancel is not None:
        cancel()


async def until_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """``await work``, unless the client disconnects first: then cancel it (and whatever it
    already produced, such as a started stream) and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # no-op once done
    await asyncio.wait({task})  # let the cancellation reach the engine future
    if task.cancelled():
        raise ClientGone
    if not gone.cancelled() and gone.done():  # left while the work finished: undo it
        if task.exception() is None:
            _cancel(task.result())
        raise ClientGone
    return task.result()


class EventStream:
    """The ASGI response of a streaming query or caption.

    The first delta is awaited before the status line, so a request the engine fails before
    generating anything (capacity, shutdown) still gets a JSON error with its status. ``finish``
    is called once, with the status to record (499 when the client left first).
    """

    def __init__(self, stream: Any, *, skill: str, request_id: str, finish: Finish) -> None:
        self.stream = stream
        self.skill = skill
        self.request_id = request_id
        self.finish = finish
        self._outcome: tuple[int, RequestMetrics | None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(scope, receive, send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pump.cancel()
            gone.cancel()
            self.stream.cancel()  # no-op once the request finished
            await asyncio.wait({pump, gone})
            failure = None if pump.cancelled() else pump.exception()
            fallback = (CLIENT_CLOSED if failure is None else 500, None)
            self.finish(*(self._outcome or fallback))
        if failure is not None:  # a bug, not an engine error: let the server log it
            raise failure

    async def _event(self, send: Send, payload: dict[str, Any]) -> None:
        data = b"data: " + json.dumps(payload).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})

    async def _pump(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = self.stream.__aiter__()
        try:
            first = await anext(chunks, None)
        except KestrelError as exc:
            err = from_exception(exc)
            self._outcome = (err.status, None)
            await error_response(err, self.request_id)(scope, receive, send)
            return
        headers = [*_SSE_HEADERS, (b"x-request-id", self.request_id.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tail = b""
        try:
            if first is not None:
                await self._event(send, self.delta_event(first))
            async for delta in chunks:
                await self._event(send, self.delta_event(delta))
            result = await self.stream.result()
        except KestrelError as exc:
            err = from_exception(exc)
            self._outcome = (err.status, None)
            await self._event(send, error_body(err, self.request_id))
        else:
            for payload in self.final_events(result):
                await self._event(send, payload)
            self._outcome = (200, result.metrics)
            tail = self.TAIL
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    # The event shapes (the chat completions stream overrides them).
    TAIL = b""  # sent after the last event of a successful stream

    def delta_event(self, delta: str) -> dict[str, Any]:
        return {"chunk": delta}

    def final_events(self, result: Any) -> list[dict[str, Any]]:
        body = result_body(self.skill, result, self.request_id, text=False)
        return [{"completed": True, **body}]

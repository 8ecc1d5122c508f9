"""The ASGI app: routes of the moondream protocol over one shared :class:`kestrel.Engine`.

A model request goes: authorize (headers only) -> take an admission slot (503 when full) ->
read the body (413 over the limit) -> parse, decode and hash in a worker thread (400) -> the
engine, raced against the client disconnecting -> a JSON body or an event stream. Nothing
invalid reaches the scheduler: the engine validates settings and text on the caller's side too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kestrel import __version__
from kestrel.errors import KestrelError
from kestrel.results import RequestMetrics
from kestrel.server.chat import ChatCall, chat_response, parse_chat, start_chat
from kestrel.server.errors import CLIENT_CLOSED, ApiError, from_exception
from kestrel.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    AdmissionGate,
    ApiKey,
    ServerLimits,
    drain_body,
    read_body,
)
from kestrel.server.metrics import CONTENT_TYPE, ServerMetrics
from kestrel.server.payloads import SKILLS, Call, parse_call
from kestrel.server.playground import playground_routes
from kestrel.server.responses import (
    ClientGone,
    EventStream,
    error_response,
    result_body,
    until_disconnected,
)

__all__ = ["create_app"]

log = logging.getLogger("kestrel.server")
_HTTP_TYPES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}


class _Exchange:
    """One request's id, clock and admission slot; :meth:`finish` records it exactly once."""

    __slots__ = ("_done", "holds_slot", "request_id", "route", "server", "started")

    def __init__(self, server: _Server, route: str) -> None:
        self.server = server
        self.route = route
        self.request_id = f"req_{server.id_prefix}{next(server.ids):06d}"
        self.started = time.perf_counter()
        self.holds_slot = False
        self._done = False

    def finish(self, status: int, metrics: RequestMetrics | None = None) -> None:
        if self._done:
            return
        self._done = True
        if self.holds_slot:
            self.server.gate.leave()
        elapsed = time.perf_counter() - self.started
        self.server.metrics.observe(self.route, status, elapsed, metrics)

    def fail(self, err: ApiError) -> Response:
        self.finish(err.status)
        return error_response(err, self.request_id)


def _start(engine: Any, call: Call) -> Awaitable[Any]:
    """The engine coroutine for a validated call (a result, or a stream when streaming)."""
    common = {"settings": call.settings, "adapter": call.adapter, "cache_salt": call.cache_salt}
    if call.skill == "query":
        refs = None if call.spatial_refs is None else [list(r) for r in call.spatial_refs]
        return engine.aquery(
            call.image, call.text, reasoning=call.reasoning, spatial_refs=refs,
            stream=call.stream, **common,
        )  # fmt: skip
    if call.skill == "caption":
        return engine.acaption(call.image, length=call.length, stream=call.stream, **common)
    if call.skill == "point":
        return engine.apoint(call.image, call.text, **common)
    return engine.adetect(call.image, call.text, **common)


def _respond(call: Call, outcome: Any, ex: _Exchange) -> Response:
    """A skill's answer: its JSON body, or its event stream."""
    if call.stream:
        return EventStream(outcome, skill=call.skill, request_id=ex.request_id, finish=ex.finish)
    ex.finish(200, outcome.metrics)
    headers = {"X-Request-ID": ex.request_id}
    return JSONResponse(result_body(call.skill, outcome, ex.request_id), headers=headers)


Parse = Callable[..., Any]  # (body, *, max_pixels) -> a validated call, in a worker thread
Start = Callable[[Any, Any], Awaitable[Any]]  # (engine, call) -> the engine's coroutine
Respond = Callable[[Any, Any, _Exchange], Response]  # (call, outcome, exchange) -> response


class _Server:
    def __init__(self, engine: Any, limits: ServerLimits, api_key: ApiKey | None) -> None:
        self.engine = engine
        self.limits = limits
        self.api_key = api_key
        self.gate = AdmissionGate(limits.max_queue)
        self.metrics = ServerMetrics()
        # Request ids: unique per app (a random prefix per start, then a counter).
        self.id_prefix = secrets.token_hex(4)
        self.ids = itertools.count(1)
        model = getattr(engine, "model_path", None)
        self.model_name = Path(model).name if model else "moondream"

    def _authorize(self, request: Request) -> None:
        if self.api_key is not None:
            self.api_key.check(request.headers)

    # ------------------------------------------------------------------ model routes
    async def skill(self, request: Request, skill: str) -> Response:
        return await self._serve(request, skill, partial(parse_call, skill), _start, _respond)

    async def chat(self, request: Request) -> Response:
        def respond(call: ChatCall, outcome: Any, ex: _Exchange) -> Response:
            return chat_response(
                call, outcome, request_id=ex.request_id, model=self.model_name, finish=ex.finish
            )

        return await self._serve(request, "chat", parse_chat, start_chat, respond)

    async def _serve(
        self, request: Request, route: str, parse: Parse, start: Start, respond: Respond
    ) -> Response:
        ex = _Exchange(self, route)
        try:
            return await self._model_call(request, ex, parse, start, respond)
        except BaseException:  # cancelled at shutdown, or a bug: still give the slot back
            ex.finish(CLIENT_CLOSED)
            raise

    async def _model_call(
        self, request: Request, ex: _Exchange, parse: Parse, start: Start, respond: Respond
    ) -> Response:
        try:
            self._authorize(request)
            self.gate.enter(self.limits.retry_after_s)
            ex.holds_slot = True
            body = await read_body(request, self.limits.max_body_bytes)
            pixels = self.limits.max_image_pixels
            upright = getattr(self.engine, "exif_orientation", True)
            call = await asyncio.to_thread(parse, body, max_pixels=pixels, exif_orientation=upright)
            outcome = await until_disconnected(request.receive, start(self.engine, call))
        except (ClientGone, ClientDisconnect):
            ex.finish(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)  # nobody is there to read it
        except Exception as exc:
            _log_failure(exc, ex)
            await drain_body(request)
            return ex.fail(from_exception(exc))
        return respond(call, outcome, ex)

    # ------------------------------------------------------------------ introspection routes
    async def health(self, request: Request) -> Response:
        ex = _Exchange(self, "health")
        status = 503 if self.engine.closed else 200
        ex.finish(status)
        model = getattr(self.engine, "model_path", None)
        body = {
            "status": "ok" if status == 200 else "closing",
            "model": Path(model).name if model else None,
            "family": served_family(self.engine),
            "adapters": self.engine.adapters(),
            "version": __version__,
        }
        return JSONResponse(body, status_code=status, headers={"X-Request-ID": ex.request_id})

    async def stats(self, request: Request) -> Response:
        ex = _Exchange(self, "stats")
        try:
            self._authorize(request)
        except ApiError as err:
            return ex.fail(err)
        body = (await asyncio.to_thread(self.engine.stats)).to_dict()
        body["server"] = {"in_flight": self.gate.in_flight, "max_queue": self.limits.max_queue}
        ex.finish(200)
        return JSONResponse(body, headers={"X-Request-ID": ex.request_id})

    async def prometheus(self, request: Request) -> Response:
        ex = _Exchange(self, "metrics")
        try:
            self._authorize(request)
        except ApiError as err:
            return ex.fail(err)
        ex.finish(200)  # recorded first, so this scrape counts itself
        stats = await asyncio.to_thread(self.engine.stats)
        text = self.metrics.render(stats, self.gate.in_flight, self.limits.max_queue)
        return Response(text, media_type=CONTENT_TYPE, headers={"X-Request-ID": ex.request_id})

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404 / 405, in this API's error shape."""
        assert isinstance(exc, HTTPException)
        ex = _Exchange(self, "other")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return ex.fail(ApiError(exc.status_code, _HTTP_TYPES.get(exc.status_code, "http_error"),
                                message, exc.headers))  # fmt: skip


def served_family(engine: Any) -> str | None:
    """The served model's family (``moondream2`` / ``moondream3``), None if unknown."""
    return getattr(getattr(engine, "config", None), "family", None)


def _log_failure(exc: Exception, ex: _Exchange) -> None:
    if isinstance(exc, ApiError) or from_exception(exc).status < 500:
        return
    if isinstance(exc, KestrelError):
        log.warning("%s %s failed: %s", ex.route, ex.request_id, exc)
    else:
        log.error("%s %s: unexpected error", ex.route, ex.request_id, exc_info=exc)


def _skill_endpoint(server: _Server, skill: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await server.skill(request, skill)

    endpoint.__name__ = skill
    return endpoint


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    retry_after_s: int = 1,
) -> Starlette:
    """The ASGI app serving ``engine`` (which the caller owns and closes).

    ``max_queue`` defaults to 4 x the engine's ``max_batch_size``. With ``api_key``, every
    route but ``/v1/health`` needs ``X-Moondream-Auth: KEY`` (or ``Authorization: Bearer KEY``).
    """
    limits = ServerLimits(
        max_body_bytes=max_body_bytes,
        max_queue=max_queue if max_queue is not None else 4 * engine.max_batch_size,
        max_image_pixels=max_image_pixels,
        retry_after_s=retry_after_s,
    )
    server = _Server(engine, limits, ApiKey(api_key) if api_key is not None else None)
    routes = [Route(f"/v1/{s}", _skill_endpoint(server, s), methods=["POST"]) for s in SKILLS]
    routes += [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/health", server.health, methods=["GET"]),
        Route("/v1/stats", server.stats, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        *playground_routes(),  # GET /: the page for trying the model in a browser
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: server.http_error})
    app.state.kestrel = server
    return app

"""The ASGI app: routes of the moondream protocol over one shared :class:`kestrel.Engine`.

Every request first passes the guard (:mod:`kestrel.server.guard`: Host and Origin, 403). A
model request then goes: authorize (headers only) -> Content-Type and query string (415 / 400)
-> take an admission slot (503 when full) -> read the body (413 over the limit) -> parse, decode
and hash in a worker thread (400) -> the engine, raced against the client disconnecting -> a
JSON body or an event stream. Nothing invalid reaches the scheduler: the engine validates
settings and text on the caller's side too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kestrel.errors import KestrelError
from kestrel.images.budget import DecodeBudget
from kestrel.images.known import KnownImages
from kestrel.server.chat import ChatCall, chat_response, parse_chat, start_chat
from kestrel.server.errors import CLIENT_CLOSED, ApiError, from_exception
from kestrel.server.exchange import Exchange as _Exchange
from kestrel.server.exchange import Ledger
from kestrel.server.guard import RequestGuard, is_loopback_host, require_json
from kestrel.server.info import InfoRoutes, model_adapter, served_family, served_name
from kestrel.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_QUEUE,
    AdmissionGate,
    ApiKey,
    ServerLimits,
    drain_body,
    read_body,
)
from kestrel.server.memory import IdleTrimmer
from kestrel.server.metrics import ServerMetrics
from kestrel.server.payloads import SKILLS, Call, parse_call
from kestrel.server.playground import playground_routes
from kestrel.server.protocol import ServedEngine, call_options, missing_members
from kestrel.server.responses import (
    ClientGone,
    EventStream,
    result_body,
    until_disconnected,
)
from kestrel.server.segment import segment_response, start_segment

__all__ = ["create_app", "served_family"]

log = logging.getLogger("kestrel.server")
_HTTP_TYPES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}


def _start(engine: ServedEngine, call: Call) -> Awaitable[Any]:
    """The engine coroutine for a validated call (a result, or a stream when streaming)."""
    common = call_options(call)
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
    if call.skill == "segment":
        return start_segment(engine, call)
    return engine.adetect(call.image, call.text, **common)


def _respond(call: Call, outcome: Any, ex: _Exchange) -> Response:
    """A skill's answer: its JSON body, or its event stream."""
    if call.skill == "segment":
        return segment_response(call, outcome, request_id=ex.request_id, finish=ex.finish)
    if call.stream:
        return EventStream(outcome, skill=call.skill, request_id=ex.request_id, finish=ex.finish)
    ex.finish(200, outcome.metrics)
    headers = {"X-Request-ID": ex.request_id}
    return JSONResponse(result_body(call.skill, outcome, ex.request_id), headers=headers)


Parse = Callable[..., Any]  # (body, *, prepare) -> a validated call, in a worker thread
Start = Callable[[ServedEngine, Any], Awaitable[Any]]  # (engine, call) -> its coroutine
Respond = Callable[[Any, Any, _Exchange], Response]  # (call, outcome, exchange) -> response


class _Server:
    """One app's state and its model routes; the describing routes are ``info``'s."""

    def __init__(self, engine: ServedEngine, limits: ServerLimits, api_key: ApiKey | None):
        self.engine = engine
        self.limits = limits
        self.api_key = api_key
        self.gate = AdmissionGate(limits.max_queue)
        self.metrics = ServerMetrics()
        self.trimmer = IdleTrimmer()
        # the last admitted request finished: hand freed heap memory back to the system
        self.ledger = Ledger(self.gate, self.metrics, on_idle=self.trimmer.poke)
        self.model_name = served_name(engine)
        # images a client sent before (each chat turn resends its image) are not decoded again
        # an Engine's image fit and decode budget, shared with its own calls' decodes; an
        # engine without (the Ray front door) gets a budget of its own, and full decodes
        self.images = KnownImages(
            max_pixels=limits.max_image_pixels, exif_orientation=engine.exif_orientation,
            fit=getattr(engine, "image_fit", None),
            budget=getattr(engine, "image_budget", None) or DecodeBudget(),
        )  # fmt: skip
        self.info = InfoRoutes(engine, self.ledger, self.authorize, self.model_name,
                               decodes_skipped=lambda: self.images.repeats)  # fmt: skip

    def authorize(self, request: Request) -> None:
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
        ex = self.ledger.open(route)
        try:
            return await self._model_call(request, ex, parse, start, respond)
        except BaseException:  # cancelled at shutdown, or a bug: still give the slot back
            ex.finish(CLIENT_CLOSED)
            raise

    async def _model_call(
        self, request: Request, ex: _Exchange, parse: Parse, start: Start, respond: Respond
    ) -> Response:
        try:
            self.authorize(request)
            require_json(request.headers)
            if request.url.query:
                raise _query_string(request)
            self.gate.enter(self.limits.retry_after_s)
            ex.holds_slot = True
            body = await read_body(request, self.limits.max_body_bytes)
            call = await asyncio.to_thread(parse, body, prepare=self.images.prepare)
            call = self._select_adapter(call)
            outcome = await until_disconnected(request.receive, start(self.engine, call))
        except (ClientGone, ClientDisconnect):
            ex.finish(CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)  # nobody is there to read it
        except Exception as exc:
            _log_failure(exc, ex)
            await drain_body(request)
            return ex.fail(from_exception(exc))
        return respond(call, outcome, ex)

    def _select_adapter(self, call: Any) -> Any:
        """A ``model`` of the form ``<served>@<adapter>`` (as ``/v1/models`` lists) selects
        that adapter; one that disagrees with ``adapter`` / ``variant`` is a 400."""
        if call.model is None or "@" not in call.model:
            return call
        chosen = model_adapter(call.model, self.model_name, self.engine.adapters())
        if chosen is None or chosen == call.adapter:
            return call
        if call.adapter is not None:
            raise ApiError(400, "invalid_request", f"'model' {call.model!r} selects adapter "
                           f"{chosen!r} but the request names {call.adapter!r}")  # fmt: skip
        return replace(call, adapter=chosen)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404 / 405, in this API's error shape."""
        assert isinstance(exc, HTTPException)
        ex = self.ledger.open("other")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return ex.fail(ApiError(exc.status_code, _HTTP_TYPES.get(exc.status_code, "http_error"),
                                message, exc.headers))  # fmt: skip


def _query_string(request: Request) -> ApiError:
    names = sorted({k for k, _ in request.query_params.multi_items()}) or [request.url.query]
    return ApiError(400, "invalid_request", f"query parameters {names} are not read by "
                    f"{request.url.path}: send every option in the JSON body")  # fmt: skip


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
    engine: ServedEngine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queue: int | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    retry_after_s: int = 1,
    bind_host: str | None = None,
    allow_origins: Sequence[str] = (),
) -> Starlette:
    """The ASGI app serving ``engine`` (which the caller owns and closes).

    ``max_queue`` defaults to :data:`DEFAULT_MAX_QUEUE` (or 4 x the engine's
    ``max_batch_size`` when that is more). With ``api_key``, every route but the health checks
    (``/v1/health``, ``/health``) and the playground page needs ``X-Moondream-Auth: KEY`` (or
    ``Authorization: Bearer KEY``). ``bind_host`` is the address the server listens on: a
    loopback one makes it refuse requests whose ``Host`` is not loopback. ``allow_origins``
    lists the web origins (``https://app.example``, or ``*``) whose pages may call the API
    (they get CORS headers); others are refused.
    """
    missing = missing_members(engine)
    if missing:
        raise TypeError(f"the app serves an engine with the ServedEngine members; "
                        f"{type(engine).__name__} lacks {', '.join(missing)}")  # fmt: skip
    queue = max_queue if max_queue is not None else max(DEFAULT_MAX_QUEUE,
                                                         4 * engine.max_batch_size)  # fmt: skip
    limits = ServerLimits(
        max_body_bytes=max_body_bytes,
        max_queue=queue,
        max_image_pixels=max_image_pixels,
        retry_after_s=retry_after_s,
    )
    server = _Server(engine, limits, ApiKey(api_key) if api_key is not None else None)
    skills = (*SKILLS, "segment")
    routes = [Route(f"/v1/{s}", _skill_endpoint(server, s), methods=["POST"]) for s in skills]
    routes += [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/health", server.info.health, methods=["GET"]),
        Route("/health", server.info.health, methods=["GET"]),  # Moondream Station's spelling
        Route("/v1/models", server.info.models, methods=["GET"]),
        Route("/v1/models/{model_id}", server.info.model, methods=["GET"]),
        Route("/v1/stats", server.info.stats, methods=["GET"]),
        Route("/metrics", server.info.prometheus, methods=["GET"]),
        *playground_routes(),  # GET /: the page for trying the model in a browser
    ]

    def refuse(err: ApiError) -> Response:
        return server.ledger.open("refused").fail(err)

    loopback = bind_host is not None and is_loopback_host(bind_host)
    middleware = [
        Middleware(RequestGuard, loopback=loopback, allow_origins=allow_origins, refuse=refuse)
    ]
    if allow_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(RequestGuard.origins_of(allow_origins)),
                allow_methods=["GET", "POST"],
                allow_headers=["Content-Type", "Authorization", "X-Moondream-Auth"],
                expose_headers=["X-Request-ID", "Retry-After"],
            )
        )
    app = Starlette(
        routes=routes, middleware=middleware, exception_handlers={HTTPException: server.http_error}
    )
    app.state.kestrel = server
    return app

"""The routes that describe the server rather than run the model: ``/v1/health`` (and ``/health``,
Moondream Station's spelling), ``/v1/models`` and ``/v1/models/{id}`` (the OpenAI shapes),
``/v1/stats``, ``/metrics``;
and the names the served model and its adapters go by."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kestrel import __version__
from kestrel.server.errors import ApiError
from kestrel.server.exchange import Exchange, Ledger
from kestrel.server.metrics import CONTENT_TYPE
from kestrel.server.protocol import ServedEngine

__all__ = ["InfoRoutes", "model_adapter", "served_family", "served_name"]

TINY_NAME = "kestrel-tiny"


def served_family(engine: ServedEngine) -> str | None:
    """The served model's family (``moondream2`` / ``moondream3``), None if unknown."""
    return engine.config.family


def served_name(engine: ServedEngine) -> str:
    """The name the served model goes by: its folder's name, ``kestrel-tiny`` for the model
    embedded in the package."""
    model = engine.model_path
    if not model:
        return "moondream"
    from kestrel.tiny import MODEL_DIR

    try:
        if Path(model).resolve() == Path(MODEL_DIR).resolve():
            return TINY_NAME
    except OSError:
        pass
    return Path(model).name or str(model)


def model_adapter(model: str | None, served: str, adapters: list[str]) -> str | None:
    """The adapter that a ``model`` field of the form ``<served>@<adapter>`` selects (the ids
    ``/v1/models`` lists); None for any other model string, which is accepted and ignored."""
    if model is None:
        return None
    base, sep, name = model.rpartition("@")
    return name if sep and base == served and name in adapters else None


@dataclass(frozen=True, slots=True, eq=False)
class InfoRoutes:
    """The describing routes of one app, over its engine, its ledger (request ids, the gate and
    its limit, the metrics) and its API key check (``authorize``: raises ApiError 401)."""

    engine: ServedEngine
    ledger: Ledger
    authorize: Callable[[Request], None]
    model_name: str
    started_at: float = field(default_factory=time.time)
    decodes_skipped: Callable[[], int] = lambda: 0  # images the app was sent again, not decoded

    async def health(self, request: Request) -> Response:
        ex = self.ledger.open("health")
        status = 503 if self.engine.closed else 200
        ex.finish(status)
        body = {
            "status": "ok" if status == 200 else "closing",
            "model": self.model_name,
            "family": served_family(self.engine),
            "adapters": self.engine.adapters(),
            "version": __version__,
        }
        return JSONResponse(body, status_code=status, headers={"X-Request-ID": ex.request_id})

    async def models(self, request: Request) -> Response:
        """The OpenAI model list: the served model, then ``model@adapter`` per adapter."""
        ex, refused = self._open(request, "models")
        if refused is not None:
            return refused
        ex.finish(200)
        body = {"object": "list", "data": self._model_objects()}
        return JSONResponse(body, headers={"X-Request-ID": ex.request_id})

    async def model(self, request: Request) -> Response:
        """One model of the list, by id (the OpenAI client's ``models.retrieve``); 404 for an
        id the list does not hold."""
        ex, refused = self._open(request, "models")
        if refused is not None:
            return refused
        wanted = request.path_params["model_id"]
        found = next((m for m in self._model_objects() if m["id"] == wanted), None)
        if found is None:
            return ex.fail(ApiError(404, "model_not_found", f"the model {wanted!r} does not exist"))
        ex.finish(200)
        return JSONResponse(found, headers={"X-Request-ID": ex.request_id})

    def _open(self, request: Request, route: str) -> tuple[Exchange, Response | None]:
        """A described route's exchange, and its 401 response where the caller may not call."""
        ex = self.ledger.open(route)
        try:
            self.authorize(request)
        except ApiError as err:
            return ex, ex.fail(err)
        return ex, None

    def _model_objects(self) -> list[dict]:
        """The served model, then ``model@adapter`` per adapter, as OpenAI's model objects."""
        created = int(self.started_at)
        ids = [self.model_name] + [f"{self.model_name}@{a}" for a in self.engine.adapters()]
        return [{"id": i, "object": "model", "created": created, "owned_by": "kestrel"}
                for i in ids]  # fmt: skip

    async def stats(self, request: Request) -> Response:
        ex, refused = self._open(request, "stats")
        if refused is not None:
            return refused
        body = (await asyncio.to_thread(self.engine.stats)).to_dict()
        gate = self.ledger.gate
        body["server"] = {"in_flight": gate.in_flight, "max_queue": gate.limit,
                          "image_decodes_skipped": self.decodes_skipped()}  # fmt: skip
        ex.finish(200)
        return JSONResponse(body, headers={"X-Request-ID": ex.request_id})

    async def prometheus(self, request: Request) -> Response:
        ex, refused = self._open(request, "metrics")
        if refused is not None:
            return refused
        ex.finish(200)  # recorded first, so this scrape counts itself
        stats = await asyncio.to_thread(self.engine.stats)
        gate = self.ledger.gate
        text = self.ledger.metrics.render(stats, gate.in_flight, gate.limit, self.decodes_skipped())
        return Response(text, media_type=CONTENT_TYPE, headers={"X-Request-ID": ex.request_id})

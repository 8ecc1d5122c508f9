"""One request's bookkeeping: its id, its clock, its admission slot and its metrics record."""

from __future__ import annotations

import time
from typing import Any

from starlette.responses import Response

from kestrel.results import RequestMetrics
from kestrel.server.errors import ApiError
from kestrel.server.responses import error_response

__all__ = ["Exchange"]


class Exchange:
    """One request's id, clock and admission slot; :meth:`finish` records it exactly once.

    ``server`` gives ``id_prefix``, ``ids``, ``gate``, ``metrics`` and ``idle()`` (called
    when the last admitted request finishes)."""

    __slots__ = ("_done", "holds_slot", "request_id", "route", "server", "started")

    def __init__(self, server: Any, route: str) -> None:
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
            if self.server.gate.in_flight == 0:
                self.server.idle()
        elapsed = time.perf_counter() - self.started
        self.server.metrics.observe(self.route, status, elapsed, metrics)

    def fail(self, err: ApiError) -> Response:
        self.finish(err.status)
        return error_response(err, self.request_id)

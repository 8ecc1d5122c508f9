"""One request's bookkeeping: its id, its clock, its admission slot and its metrics record."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable

from starlette.responses import Response

from kestrel.results import RequestMetrics
from kestrel.server.errors import ApiError
from kestrel.server.limits import AdmissionGate
from kestrel.server.metrics import ServerMetrics
from kestrel.server.responses import error_response

__all__ = ["Exchange", "Ledger"]


class Ledger:
    """What every exchange of one app shares: request ids (unique per app: a random prefix per
    start, then a counter), the admission gate, the metrics, and ``on_idle`` (called when the
    last admitted request finishes)."""

    def __init__(self, gate: AdmissionGate, metrics: ServerMetrics, on_idle: Callable[[], None]):
        self.gate = gate
        self.metrics = metrics
        self.on_idle = on_idle
        self._prefix = secrets.token_hex(4)
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return f"req_{self._prefix}{next(self._ids):06d}"

    def open(self, route: str) -> Exchange:
        return Exchange(self, route)


class Exchange:
    """One request's id, clock and admission slot; :meth:`finish` records it exactly once."""

    __slots__ = ("_done", "holds_slot", "ledger", "request_id", "route", "started")

    def __init__(self, ledger: Ledger, route: str) -> None:
        self.ledger = ledger
        self.route = route
        self.request_id = ledger.new_id()
        self.started = time.perf_counter()
        self.holds_slot = False
        self._done = False

    def finish(self, status: int, metrics: RequestMetrics | None = None) -> None:
        if self._done:
            return
        self._done = True
        ledger = self.ledger
        if self.holds_slot:
            ledger.gate.leave()
            if ledger.gate.in_flight == 0:
                ledger.on_idle()
        elapsed = time.perf_counter() - self.started
        ledger.metrics.observe(self.route, status, elapsed, metrics)

    def fail(self, err: ApiError) -> Response:
        self.finish(err.status)
        return error_response(err, self.request_id)

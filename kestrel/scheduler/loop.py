"""The scheduler thread: one inbox queue in, futures out.

Callers put requests (and calls to run between steps, such as stats or integrity checks) into
the inbox; the thread drains it, steps the scheduler while there is work, and blocks on the
inbox when idle. ``close`` is ordered after every submission that got in before it: those
requests, and everything running, fail with EngineClosedError and release what they hold.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kestrel.errors import EngineClosedError, ModelError
from kestrel.scheduler import Request, Scheduler

__all__ = ["SchedulerLoop"]

log = logging.getLogger("kestrel.engine")

_STOP = object()


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``fn`` on the scheduler thread between steps; report through ``future``."""

    fn: Callable[[], Any]
    future: Future


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, *, name: str = "kestrel-scheduler") -> None:
        self.scheduler = scheduler
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against close()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, request: Request) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            self._inbox.put(request)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread between steps (directly once closed and joined)."""
        call = _Call(fn, Future())
        with self._lock:
            queued = not self._closed
            if queued:
                self._inbox.put(call)
        if queued:
            return call.future.result()
        self._thread.join()  # once the thread is gone nothing else touches the state
        return fn()

    def pause(self) -> threading.Event:
        """Hold the thread before its next step until the returned event is set (tests use it
        to make everything submitted meanwhile arrive in one batch)."""
        gate = threading.Event()
        with self._lock:
            if not self._closed:
                self._inbox.put(_Call(gate.wait, Future()))
        return gate

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        sched = self.scheduler
        while True:
            try:
                msg = self._inbox.get(block=not sched.has_work())
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg is _STOP:
                    self._shutdown()
                    return
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if sched.has_work():
                try:
                    sched.step()
                except Exception as exc:  # a scheduler bug: fail what is in flight, go on
                    log.exception("scheduler step failed")
                    sched.abort_all(lambda exc=exc: ModelError(f"scheduler failure: {exc!r}"))

    def _handle(self, msg: object) -> None:
        if isinstance(msg, Request):
            self.scheduler.submit(msg)
        elif isinstance(msg, _Call):
            try:
                msg.future.set_result(msg.fn())
            except Exception as exc:
                msg.future.set_exception(exc)

    def _shutdown(self) -> None:
        while True:  # requests that got in before close()
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(msg)
        self.scheduler.abort_all(
            lambda: EngineClosedError("the engine was closed before the request finished")
        )

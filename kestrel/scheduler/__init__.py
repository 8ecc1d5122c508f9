"""The single-threaded scheduler: admit -> prefill -> batched decode -> retire.

Plain Python over a small executor protocol; it never imports model code, so tests drive it with
fakes and no threads.
"""

from __future__ import annotations

from kestrel.scheduler.protocol import Capacity, Executor, ExecutorOverloaded, Request, Started
from kestrel.scheduler.scheduler import Scheduler, SchedulerCounters, WaitQueue, as_request_error
from kestrel.scheduler.state import RunningSet, SequenceRun

__all__ = [
    "Capacity",
    "Executor",
    "ExecutorOverloaded",
    "Request",
    "RunningSet",
    "Scheduler",
    "SchedulerCounters",
    "SequenceRun",
    "Started",
    "WaitQueue",
    "as_request_error",
]

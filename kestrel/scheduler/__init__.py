"""The single-threaded scheduler: admit -> prefill -> batched decode -> retire.

Plain Python over a small runner protocol; it never imports model code, so tests drive it with
fakes and no threads.
"""

from __future__ import annotations

from kestrel.scheduler.protocol import Capacity, ModelRunner, Request, RunnerOverloaded, Started
from kestrel.scheduler.scheduler import Scheduler, SchedulerCounters, WaitQueue, as_request_error
from kestrel.scheduler.state import RunningSet, SequenceRun

__all__ = [
    "Capacity",
    "ModelRunner",
    "Request",
    "RunnerOverloaded",
    "RunningSet",
    "Scheduler",
    "SchedulerCounters",
    "SequenceRun",
    "Started",
    "WaitQueue",
    "as_request_error",
]

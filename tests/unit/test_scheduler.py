"""The scheduler driven directly (no threads, no model): admission, capacity, cancellation,
failure isolation. A fake executor keeps its own page and row accounting and checks it."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future

import pytest

from kestrel.errors import CapacityError, ModelError
from kestrel.scheduler import Capacity, ExecutorOverloaded, Request, Scheduler, Started
from kestrel.skills.base import Skill
from kestrel.tokens import TextToken


class CountSkill(Skill):
    """Feeds ``n`` tokens, then stops; raises on feed ``fail_at`` if set."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.prompt = [TextToken(0)] * 4
        self.max_feeds = n
        self.n, self.fail_at, self.fed = n, fail_at, 0

    def advance(self, logits_V, hidden_C, budget):
        if self.fail_at is not None and self.fed == self.fail_at:
            raise RuntimeError("skill bug")
        if self.fed >= self.n:
            self._finish("stop")
            return None
        if budget <= 0:
            self._finish("length")
            return None
        self.fed += 1
        return TextToken(1)

    def output_tokens(self):
        return (1,) * self.fed


class FakeExecutor:
    def __init__(self, pages: int = 100, rows: int = 4) -> None:
        self.pages, self.rows = pages, rows
        self.held: dict[int, int] = {}  # handle -> pages
        self.fail_start: set[int] = set()  # request ids whose prefill raises
        self.overload: set[int] = set()  # request ids refused as overloaded (once)
        self.fail_decode_call: int | None = None
        self.decode_calls = 0
        self.lookaheads: list[bool] = []
        self.decode_batches: list[list[int]] = []
        self.start_calls: list[list[int]] = []
        self._next = 0

    def capacity(self) -> Capacity:
        used = sum(self.held.values())
        return Capacity(self.rows - len(self.held), self.pages - used, self.pages)

    def start(self, request: Request) -> Started:
        if request.request_id in self.overload:
            self.overload.discard(request.request_id)
            raise ExecutorOverloaded("no rows right now")
        if request.request_id in self.fail_start:
            raise RuntimeError("prefill blew up")
        cap = self.capacity()
        assert cap.free_rows > 0 and cap.available_pages >= request.pages_needed
        self._next += 1
        self.held[self._next] = request.pages_needed
        return Started(self._next, "logits", "hidden", request.prompt_positions, 0, False)

    def start_many(self, requests):
        """One outcome per request; once one is refused as overloaded, so is the rest."""
        self.start_calls.append([r.request_id for r in requests])
        out = []
        for request in requests:
            if out and isinstance(out[-1], ExecutorOverloaded):
                out.append(ExecutorOverloaded("no rows right now"))
                continue
            try:
                out.append(self.start(request))
            except Exception as exc:
                out.append(exc)
        return out

    def decode(self, handles, tokens, *, lookahead=False):
        self.decode_calls += 1
        self.lookaheads.append(lookahead)
        assert all(h in self.held for h in handles) and len(handles) == len(tokens)
        self.decode_batches.append(list(handles))
        if self.decode_calls == self.fail_decode_call:
            raise RuntimeError("decode blew up")
        return ["logits"] * len(handles), ["hidden"] * len(handles)

    def release(self, handle) -> None:
        del self.held[handle]

    def check_integrity(self) -> None:
        assert sum(self.held.values()) <= self.pages


_ids = iter(range(1, 10**9))


def make_request(n: int = 3, *, positions: int = 10, fail_at: int | None = None) -> Request:
    skill = CountSkill(n, fail_at)
    return Request(
        request_id=next(_ids),
        skill=skill,
        image=None,
        adapter=None,
        prompt_positions=positions,
        max_new_tokens=n,
        future=Future(),
        build_result=lambda s, m: (s.output_tokens(), m),
        submitted_at=time.perf_counter(),
    )


def drain(s: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not s.has_work():
            return
        s.step()
        s.check_integrity()
    raise AssertionError("scheduler did not drain")


def test_batches_and_results() -> None:
    executor = FakeExecutor(rows=4)
    s = Scheduler(executor)
    reqs = [make_request(3) for _ in range(6)]
    for r in reqs:
        s.submit(r)
    drain(s)
    for r in reqs:
        tokens, metrics = r.future.result()
        assert tokens == (1, 1, 1) and metrics.output_tokens == 3
        assert metrics.input_tokens == 10 and metrics.ttft_ms >= metrics.queue_ms >= 0
    assert max(len(b) for b in executor.decode_batches) == 4  # rows were shared
    assert executor.held == {} and s.counters.served == 6
    # the four requests admitted in the first step reach the executor in one call, in order
    assert executor.start_calls[0] == [r.request_id for r in reqs[:4]]
    assert sorted(i for call in executor.start_calls for i in call) == [r.request_id for r in reqs]


def test_lookahead_only_when_no_admission_is_likely() -> None:
    """The executor may queue the next step early only when nothing waits and no row retired
    since the last step (a retired row's replacement is likely to arrive next)."""
    executor = FakeExecutor(rows=2)
    s = Scheduler(executor)
    long, short = make_request(8), make_request(2)
    s.submit(long)
    s.submit(short)
    s.step()  # both admitted, nothing waiting
    assert executor.lookaheads == [True]
    s.submit(make_request(2))  # waits for a row
    s.step()
    assert executor.lookaheads[-1] is False
    while len(s.running) == 2:  # until `short` retires and the waiting one is admitted
        s.step()
    s.step()  # the step after the retirement admitted the waiting one
    s.step()
    assert executor.lookaheads[-1] is True and not s.waiting
    drain(s)
    assert executor.held == {} and long.future.result()[0] == (1,) * 8


def test_head_of_line_waits_for_pages_and_never_fitting_fails_alone() -> None:
    executor = FakeExecutor(pages=40, rows=4)
    s = Scheduler(executor)
    small = make_request(5, positions=10)  # 15 pages
    big = make_request(5, positions=25)  # 30 pages: waits for `small`
    after = make_request(1, positions=5)  # would fit now, but must not overtake `big`
    never = make_request(10, positions=35)  # 45 > 40 pages
    for r in (small, big, never, after):
        s.submit(r)
    s.step()
    assert len(s.running) == 1 and not big.future.done()
    with pytest.raises(CapacityError, match="pool has 40"):
        never.future.result(timeout=0)
    drain(s)
    assert all(r.future.result()[0] for r in (small, big, after))
    assert s.counters.failed == 1 and executor.held == {}


def test_overloaded_runner_requeues_or_fails_when_nothing_runs() -> None:
    executor = FakeExecutor()
    s = Scheduler(executor)
    first, second = make_request(3), make_request(3)
    executor.overload = {second.request_id}
    s.submit(first)
    s.submit(second)
    s.step()  # first runs; second is refused and waits at the head of the queue
    assert len(s.waiting) == 1 and not second.future.done()
    drain(s)
    assert second.future.result()[0] == (1, 1, 1)

    lonely = make_request(3)
    executor.overload = {lonely.request_id}
    s.submit(lonely)
    s.step()
    with pytest.raises(CapacityError):
        lonely.future.result(timeout=0)


def test_cancel_waiting_and_running_release_everything() -> None:
    executor = FakeExecutor(rows=1)
    s = Scheduler(executor)
    running, waiting = make_request(50), make_request(3)
    s.submit(running)
    s.submit(waiting)
    s.step()
    assert running.future.cancel() and waiting.future.cancel()
    s.step()
    assert executor.held == {} and not s.has_work()
    assert s.counters.cancelled == 2
    with pytest.raises(CancelledError):
        running.future.result(timeout=0)


def test_failures_are_isolated() -> None:
    executor = FakeExecutor(rows=8)
    s = Scheduler(executor)
    ok = make_request(4)
    bad_prefill = make_request(4)
    bad_skill = make_request(4, fail_at=2)
    for r in (ok, bad_prefill, bad_skill):
        s.submit(r)
    executor.fail_start = {bad_prefill.request_id}
    drain(s)
    assert ok.future.result()[0] == (1,) * 4
    with pytest.raises(ModelError, match="prefill blew up"):
        bad_prefill.future.result()
    with pytest.raises(ModelError, match="skill bug"):
        bad_skill.future.result()
    assert executor.held == {}


def test_decode_failure_fails_that_step_only() -> None:
    executor = FakeExecutor(rows=2)
    s = Scheduler(executor)
    reqs = [make_request(3) for _ in range(4)]
    for r in reqs:
        s.submit(r)
    executor.fail_decode_call = 2
    drain(s)
    outcomes = ["ok" if r.future.exception() is None else "failed" for r in reqs]
    assert outcomes == ["failed", "failed", "ok", "ok"]
    assert executor.held == {}


def test_budget_ends_a_skill_with_length() -> None:
    executor = FakeExecutor()
    s = Scheduler(executor)
    r = make_request(10)
    r = Request(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "max_new_tokens": 4})
    s.submit(r)
    drain(s)
    assert r.skill.finish_reason == "length" and r.future.result()[0] == (1,) * 4


def test_abort_all() -> None:
    executor = FakeExecutor(rows=1)
    s = Scheduler(executor)
    a, b = make_request(20), make_request(20)
    s.submit(a)
    s.submit(b)
    s.step()
    s.abort_all(lambda: CapacityError("closing"))
    assert not s.has_work() and executor.held == {}
    for f in (a.future, b.future):
        with pytest.raises(CapacityError, match="closing"):
            f.result(timeout=0)

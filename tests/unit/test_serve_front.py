"""The front door of ``kestrel serve --ray`` without a cluster: ClusterEngine and RelayStream over
fake replica handles (results, engine errors, lost replicas, streams ended, failed and cancelled,
each counted in flight exactly once), the routing keys, and the stats sum."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason='needs the ray extra: pip install "kestrel[ray]"')

from ray.exceptions import ActorDiedError

from kestrel.distributed.frontdoor import (
    ClusterEngine,
    ReplicaLink,
    ReplicaLostError,
    routing_key,
)
from kestrel.distributed.ring import Router
from kestrel.distributed.serve_replica import Failure, Final
from kestrel.distributed.serve_stats import cluster_stats
from kestrel.errors import EngineClosedError, InvalidInputError, KestrelError
from kestrel.images import prepare_image
from kestrel.results import EngineStats
from kestrel.server.errors import from_exception

INFO = {"model_path": "/m/tiny", "family": "moondream2", "adapters": ["fr"], "max_batch_size": 4}
IMAGE = prepare_image(np.full((8, 8, 3), 7, dtype=np.uint8))


class _Response:
    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Gen:
    def __init__(self, items) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, make) -> None:
        self.make = make
        self.calls: list = []

    def remote(self, *args):
        self.calls.append(args)
        return self.make()


class _Handle:
    """A replica handle whose unary calls give ``outcome`` and whose streams yield ``items``."""

    def __init__(self, outcome=None, items=()) -> None:
        self.call = _Method(lambda: _Response(outcome))
        self.gens: list[_Gen] = []
        self.stream = _Method(lambda: self.gens.append(_Gen(items)) or self.gens[-1])

    def options(self, **_):
        return self


def _door(handle: _Handle) -> ClusterEngine:
    return ClusterEngine([ReplicaLink("r0", handle, INFO)], Router(["r0"]))


def _in_flight(door: ClusterEngine) -> int:
    return door.router.snapshot().in_flight["r0"]


def test_the_engine_face() -> None:
    door = _door(_Handle())
    assert (door.model_path, door.config.family, door.adapters()) == (
        "/m/tiny",
        "moondream2",
        ["fr"],
    )
    assert door.max_batch_size == 4 and not door.closed and not door.supports_segment


def test_results_pass_and_engine_errors_are_raised_again() -> None:
    door = _door(_Handle(outcome="the result"))
    assert asyncio.run(door.aquery(IMAGE, "q?", settings={"max_tokens": 2})) == "the result"
    skill, args, kwargs = door.links["r0"].handle.call.calls[0]
    assert (skill, args, kwargs) == ("query", (IMAGE, "q?"), {"settings": {"max_tokens": 2}})
    assert args[0] is IMAGE  # the prepared image itself travels, not the upload
    bad = _door(_Handle(outcome=Failure(InvalidInputError("question must not be empty"))))
    with pytest.raises(InvalidInputError, match="must not be empty"):
        asyncio.run(bad.adetect(IMAGE, " "))
    assert _in_flight(door) == _in_flight(bad) == 0


def test_a_lost_replica_is_a_503_with_retry_after_and_leaves_the_ring() -> None:
    door = _door(_Handle(outcome=ActorDiedError()))
    with pytest.raises(ReplicaLostError) as caught:
        asyncio.run(door.acaption(IMAGE))
    err = from_exception(caught.value)
    assert (err.status, err.type, err.headers) == (503, "replica_unavailable", {"Retry-After": "1"})
    assert isinstance(caught.value, KestrelError)  # so a started stream reports it as an event
    assert door.router.snapshot().live == {"r0": False} and _in_flight(door) == 0
    with pytest.raises(ReplicaLostError, match="no replica is live"):
        asyncio.run(door.apoint(IMAGE, "dot"))
    door.router.set_live("r0", True)
    door.close()
    with pytest.raises(EngineClosedError):
        asyncio.run(door.aquery(IMAGE, "q?"))


def _streamed(door: ClusterEngine, cancel_after: int | None = None):
    async def go():
        s = await door.aquery(IMAGE, "q?", stream=True)
        got = []
        async for delta in s:
            got.append(delta)
            if cancel_after is not None and len(got) == cancel_after:
                s.cancel()
                return got, None
        return got, await s.result()

    return asyncio.run(go())


def test_streams_end_fail_and_cancel_counted_once() -> None:
    done = _door(_Handle(items=["a", "b", Final("result")]))
    assert _streamed(done) == (["a", "b"], "result")
    assert _in_flight(done) == 0 and not done.links["r0"].handle.gens[0].cancelled

    refused = _door(_Handle(items=[Failure(InvalidInputError("bad settings"))]))
    with pytest.raises(InvalidInputError):  # before any text: raised by the call itself
        _streamed(refused)
    assert _in_flight(refused) == 0

    died = _door(_Handle(items=["a", ActorDiedError()]))
    with pytest.raises(ReplicaLostError):
        _streamed(died)
    assert _in_flight(died) == 0 and died.router.snapshot().live == {"r0": False}

    left = _door(_Handle(items=["a", "b", "c", Final("result")]))
    assert _streamed(left, cancel_after=1) == (["a"], None)
    assert _in_flight(left) == 0 and left.links["r0"].handle.gens[0].cancelled


def test_routing_keys_and_a_chat_goes_by_its_first_image() -> None:
    assert routing_key(IMAGE, "q?") == IMAGE.digest == routing_key(IMAGE, "other?")
    assert routing_key(None, "q?") == routing_key(None, "q?") != routing_key(None, "r?")
    names = [f"r{i}" for i in range(8)]
    door = ClusterEngine([ReplicaLink(n, _Handle(outcome="ok"), INFO) for n in names],
                         Router(names))  # fmt: skip
    part = {"type": "image", "image": IMAGE}
    later = {"type": "image", "image": prepare_image(np.zeros((8, 8, 3), dtype=np.uint8))}
    hello = {"role": "user", "content": "hi"}
    chat = [hello, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [part, {"type": "text", "text": "and this?"}]},
            {"role": "user", "content": [later]}]  # fmt: skip
    for messages, key in ((chat, IMAGE.digest), ([hello], routing_key(None, hello))):
        asyncio.run(door.achat(messages))
        called = [n for n in names if door.links[n].handle.call.calls]
        assert called == [door.router.ring.owner(key, set(names))]
        door.links[called[0]].handle.call.calls.clear()


def _engine(**kw) -> dict:
    base = EngineStats(*([0] * 5), 0.0, *([0] * 10)).to_dict()
    return {**base, "name": "ip:1", "prompt_tokens": 0, "vision_encodes": 0, **kw}


def test_cluster_stats_sum_the_replicas_that_answered() -> None:
    router = Router(["r0", "r1", "r2"])
    router.set_live("r2", False)
    found = {
        "r0": _engine(requests_served=3, prefill_tokens_saved=30, prompt_tokens=100,
                      hit_rate=0.3, vision_encodes=1, pages_total=50),
        "r1": _engine(requests_served=1, prefill_tokens_saved=0, prompt_tokens=60,
                      vision_encodes=1, pages_total=50),
        "r2": None,
    }  # fmt: skip
    s = cluster_stats(found, router.snapshot())
    assert (s.requests_served, s.vision_encodes, s.pages_total) == (4, 2, 100)
    assert s.hit_rate == pytest.approx(30 / 160, rel=1e-12)
    r2 = s.replicas[2]
    assert (r2.live, r2.process, r2.requests_served) == (False, None, None)
    assert s.replicas[0].cached_tokens == 30 and s.to_dict()["replicas"][1]["prompt_tokens"] == 60
    empty = cluster_stats({"r0": None}, Router(["r0"]).snapshot())
    assert replace(empty, replicas=()).hit_rate == 0.0 and empty.requests_served == 0


class _Probe:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.cancelled = False

    def result(self, timeout_s: float):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class _Describe:
    def __init__(self) -> None:
        self.answer: object = TimeoutError("still loading its model")
        self.probes: list[_Probe] = []

    def remote(self):
        self.probes.append(_Probe(self.answer))
        return self.probes[-1]


def test_the_health_monitor_takes_a_silent_replica_off_and_a_loaded_one_back() -> None:
    from kestrel.distributed.serve_cluster import HealthMonitor

    handle = _Handle(outcome="ok")
    handle.describe = _Describe()
    door = _door(handle)
    monitor = HealthMonitor(door, period_s=60.0, timeout_s=0.01)
    monitor.probe_once()  # restarting: the probe waits on a replica still loading its model
    assert door.router.snapshot().live == {"r0": False}
    assert handle.describe.probes[-1].cancelled  # a probe left unanswered does not pile up
    with pytest.raises(ReplicaLostError):
        asyncio.run(door.aquery(IMAGE, "q?"))  # no traffic while it loads
    handle.describe.answer = {**INFO, "name": "ip:2"}  # loaded, in a new process
    monitor.probe_once()
    assert door.router.snapshot().live == {"r0": True} and door.links["r0"].info["name"] == "ip:2"
    assert asyncio.run(door.aquery(IMAGE, "q?")) == "ok"


@pytest.mark.parametrize(
    ("resources", "wanted", "engine", "n", "actor", "device", "threads"),
    [
        ({"CPU": 64, "GPU": 8}, None, {}, 8, {"num_gpus": 1, "num_cpus": 1}, "cuda", None),
        ({"CPU": 64, "GPU": 8}, 3, {"device": "auto"}, 3, {"num_gpus": 1, "num_cpus": 1}, "cuda",
         None),
        ({"CPU": 8, "GPU": 2}, 2, {"device": "cpu"}, 2, {"num_cpus": 4.0}, "cpu", 4),
        ({"CPU": 2}, None, {}, 2, {"num_cpus": 1.0}, "auto", 1),
        ({"CPU": 9}, 4, {}, 4, {"num_cpus": 2.0}, "auto", 2),
    ],
)  # fmt: skip
def test_placement_one_gpu_each_else_a_share_of_the_cpus(
    monkeypatch, resources, wanted, engine, n, actor, device, threads
) -> None:
    from kestrel.distributed import serve_cluster
    from kestrel.distributed.replica import ReplicaOptions

    monkeypatch.setattr(serve_cluster.ray, "cluster_resources", lambda: resources)
    options = serve_cluster.ServeOptions(replicas=wanted)
    got_n, replica, got_actor = serve_cluster.placement(ReplicaOptions(engine=engine), options)
    assert (got_n, got_actor) == (n, actor)
    assert replica.engine.device == device and replica.threads == threads


def test_placement_refuses_more_than_the_cluster_has(monkeypatch) -> None:
    from kestrel.distributed import serve_cluster
    from kestrel.distributed.replica import ReplicaOptions

    for resources, wanted, match in (({"CPU": 64, "GPU": 2}, 3, "3 GPUs"),
                                     ({"CPU": 2}, 3, "need 3")):  # fmt: skip
        monkeypatch.setattr(serve_cluster.ray, "cluster_resources", lambda r=resources: r)
        with pytest.raises(InvalidInputError, match=match):
            serve_cluster.placement(ReplicaOptions(), serve_cluster.ServeOptions(replicas=wanted))


def test_a_call_refused_at_once_by_serve_is_a_lost_replica_and_holds_nothing() -> None:
    from ray.serve.exceptions import DeploymentUnavailableError

    for stream in (False, True):
        handle = _Handle()
        refused = _Method(lambda: (_ for _ in ()).throw(DeploymentUnavailableError("r0")))
        handle.call = handle.stream = refused
        door = _door(handle)
        with pytest.raises(ReplicaLostError):
            asyncio.run(door.aquery(IMAGE, "q?", stream=stream))
        assert _in_flight(door) == 0 and door.router.snapshot().live == {"r0": False}

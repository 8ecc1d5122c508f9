"""The front door's routing (kestrel/distributed/ring.py): a consistent-hash ring over live
replicas, keys that move only when their replica leaves and come back when it returns, the
bounded-load fallback and random routing."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

pytest.importorskip("ray.data", reason='needs the ray extra: pip install "kestrel[ray]"')

from kestrel.distributed.ring import HashRing, NoReplicaError, Router

NAMES = [f"kestrel-replica-{i}" for i in range(4)]
KEYS = [hashlib.sha256(f"image {i}".encode()).digest() for i in range(2000)]


def test_keys_spread_and_only_a_lost_replicas_keys_move() -> None:
    ring = HashRing(NAMES)
    live = set(NAMES)
    before = {k: ring.owner(k, live) for k in KEYS}
    shares = Counter(before.values())
    assert set(shares) == set(NAMES)
    assert max(shares.values()) < 2 * min(shares.values()), shares  # 64 points each
    lost = NAMES[1]
    after = {k: ring.owner(k, live - {lost}) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == lost for k in moved)
    assert all(after[k] != lost for k in KEYS)
    assert len(set(after[k] for k in moved)) == 3  # spread over every other replica
    assert {k: ring.owner(k, live) for k in KEYS} == before  # back: the same keys return


def test_ring_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="distinct"):
        HashRing(["a", "a"])
    with pytest.raises(ValueError, match="distinct"):
        HashRing([])
    with pytest.raises(NoReplicaError):
        HashRing(["a"]).owner(KEYS[0], set())


def test_router_keeps_a_key_on_its_replica_until_load_diverts_it() -> None:
    router = Router(NAMES, slack=2)
    key = KEYS[0]
    home = router.ring.owner(key, set(NAMES))
    held = [router.begin(key) for _ in range(3)]  # home at 3 in flight, others at 0
    assert held == [home] * 3
    other = router.begin(key)  # 3 - 0 > slack: the least loaded replica instead
    assert other != home
    snap = router.snapshot()
    assert snap.diverted == 1 and snap.in_flight[home] == 3 and snap.in_flight[other] == 1
    for name in [*held, other]:
        router.end(name)
    assert router.begin(key) == home  # load gone: back home
    router.end(home)
    assert sum(router.snapshot().in_flight.values()) == 0
    assert router.snapshot().routed[home] == 4


def test_router_skips_replicas_off_the_ring() -> None:
    router = Router(NAMES[:2])
    key = next(k for k in KEYS if router.ring.owner(k, set(NAMES[:2])) == NAMES[0])
    assert router.set_live(NAMES[0], False) is True
    assert router.set_live(NAMES[0], False) is False  # no change
    assert router.begin(key) == NAMES[1]
    router.end(NAMES[1])
    router.set_live(NAMES[1], False)
    with pytest.raises(NoReplicaError):
        router.begin(key)
    router.set_live(NAMES[0], True)
    assert router.begin(key) == NAMES[0]
    assert router.snapshot().live == {NAMES[0]: True, NAMES[1]: False}


def test_random_routing_ignores_the_key() -> None:
    router = Router(NAMES, routing="random", seed=3)
    chosen = Counter(router.begin(KEYS[0]) for _ in range(400))
    assert set(chosen) == set(NAMES)
    with pytest.raises(ValueError, match="routing"):
        Router(NAMES, routing="round-robin")

"""Choosing a replica per request: a consistent-hash ring over the live replicas, with a
bounded-load fallback. Pure Python; the front door owns one :class:`Router`.

Each replica has ``vnodes`` points on a 64-bit ring (the SHA-256 of ``"name#i"``); a key (an
image's content digest) belongs to the first point clockwise of its own hash whose replica is
live. Removing a replica moves only its keys, each to the next live point (spread over the
others); bringing it back moves the same keys back. Bounded load: when the key's replica has
more than ``slack`` requests in flight beyond the least loaded live replica, the request goes
to the least loaded one instead (its image is then encoded there, once).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ROUTINGS", "HashRing", "NoReplicaError", "Router", "RouterSnapshot"]

ROUTINGS = ("image", "random")


class NoReplicaError(RuntimeError):
    """No replica is live (all dead, restarting or still loading)."""


def _point(text: bytes) -> int:
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


class HashRing:
    """The ring: ``owner(key, live)`` is the key's replica among ``live``."""

    def __init__(self, names: Sequence[str], vnodes: int = 64) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a ring needs distinct replica names, got {list(names)}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        points = sorted((_point(f"{n}#{i}".encode()), n) for n in names for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self.names = tuple(names)

    def owner(self, key: bytes, live: set[str] | frozenset[str]) -> str:
        """The first live replica clockwise from ``key``'s point."""
        if not live:
            raise NoReplicaError("no replica is live")
        start = bisect.bisect_left(self._hashes, _point(key))
        n = len(self._names)
        for step in range(n):
            name = self._names[(start + step) % n]
            if name in live:
                return name
        raise NoReplicaError(f"none of {sorted(live)} is on this ring")


@dataclass(frozen=True, slots=True)
class RouterSnapshot:
    """Per replica: live or not, requests in flight now, requests routed since start, and how
    many of those went elsewhere than the ring's choice (bounded load)."""

    live: dict[str, bool]
    in_flight: dict[str, int]
    routed: dict[str, int]
    diverted: int


class Router:
    """Thread-safe: requests are routed on the event loop, liveness changes come from the
    health monitor's thread.

    ``routing="image"``: the ring with bounded load; ``"random"``: any live replica, uniformly
    (the comparison a cache-blind load balancer gives)."""

    def __init__(
        self, names: Sequence[str], *, routing: str = "image", slack: int = 8, seed: int = 0
    ) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.ring = HashRing(names)
        self.routing = routing
        self.slack = slack
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._live = set(names)
        self._in_flight = dict.fromkeys(names, 0)
        self._routed = dict.fromkeys(names, 0)
        self._diverted = 0

    def begin(self, key: bytes) -> str:
        """The replica for a request keyed by ``key``, counted in flight until :meth:`end`."""
        with self._lock:
            if not self._live:
                raise NoReplicaError("no replica is live (restarting or loading its model)")
            if self.routing == "random":
                name = self._random.choice(sorted(self._live))
            else:
                name = self.ring.owner(key, self._live)
                # Nobody is below 0 in flight: only a replica over ``slack`` can be diverted
                # from, so the common case never scans the replicas.
                if self._in_flight[name] > self.slack:
                    least = min(sorted(self._live), key=self._in_flight.__getitem__)
                    if self._in_flight[name] - self._in_flight[least] > self.slack:
                        name = least
                        self._diverted += 1
            self._in_flight[name] += 1
            self._routed[name] += 1
            return name

    def end(self, name: str) -> None:
        with self._lock:
            self._in_flight[name] -= 1

    def set_live(self, name: str, live: bool) -> bool:
        """Mark ``name`` live or not; True if that changed anything."""
        with self._lock:
            was = name in self._live
            if live:
                self._live.add(name)
            else:
                self._live.discard(name)
            return was != live

    def is_live(self, name: str) -> bool:
        with self._lock:
            return name in self._live

    def snapshot(self) -> RouterSnapshot:
        with self._lock:
            return RouterSnapshot(
                live={n: n in self._live for n in self.ring.names},
                in_flight=dict(self._in_flight),
                routed=dict(self._routed),
                diverted=self._diverted,
            )

"""The pinned host ring (``kestrel_kernels/pinned.py``): slots handed out round-robin, a slot's
unread read-back read before the slot is reused, too-big requests refused; on a CPU device
nothing is reserved."""

from __future__ import annotations

import pytest
import torch

from kestrel_kernels import pinned


class Reader:
    def __init__(self) -> None:
        self.settled = 0

    def settle(self) -> None:
        self.settled += 1


def test_slots_round_robin_and_staged_values() -> None:
    ring = pinned.HostRing(3, 100, pin=False)
    assert ring.slot_bytes == 128  # aligned
    slots = [ring.take(16)[0] for _ in range(4)]
    assert slots == [0, 1, 2, 0]
    host = torch.arange(12, dtype=torch.int64).view(3, 4)
    slot, view = ring.staged(host)
    assert slot == 1 and torch.equal(view, host) and view.dtype == torch.int64
    host += 1  # the staged copy is its own
    assert not torch.equal(view, host)
    assert ring.take(129) is None and ring.staged(torch.zeros(17, dtype=torch.int64)) is None


def test_an_unread_reader_is_settled_before_its_slot_is_reused() -> None:
    ring = pinned.HostRing(2, 64, pin=False)
    a, b, c = Reader(), Reader(), Reader()
    slot_a, target = ring.empty_like(torch.zeros(4, dtype=torch.int32), a)
    assert target.shape == (4,) and target.dtype == torch.int32
    ring.take(8, b)
    ring.released(ring.take(8, c)[0], c)  # slot 0 again: a had not read, so it reads now
    assert (a.settled, b.settled, c.settled) == (1, 0, 0) and ring.waits == 1
    ring.take(8)  # slot 1: b still unread
    assert b.settled == 1
    ring.take(8)  # slot 0: c said it had read
    assert c.settled == 0 and slot_a == 0


def test_cpu_devices_reserve_nothing() -> None:
    assert pinned.reserve("cpu") is None and pinned.ring(torch.device("cpu")) is None
    with pytest.raises(ValueError):
        pinned.HostRing(0, 8, pin=False)

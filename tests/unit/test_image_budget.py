"""Decoded image bytes in flight are bounded (kestrel/images/budget.py): a decode takes its
peak from the budget before any pixel is decoded, keeps its array's bytes until the array is
freed, waits while the budget is full and is refused (OverloadedError) after its wait."""

from __future__ import annotations

import gc
import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from kestrel.errors import OverloadedError
from kestrel.images import prepare_image
from kestrel.images.budget import DecodeBudget, default_budget_bytes


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def test_a_charge_shrinks_to_its_array_and_returns_when_the_array_is_freed() -> None:
    budget = DecodeBudget(1000)
    charge = budget.take(800)
    assert budget.in_use == 800
    array = charge.settle(np.zeros(300, np.uint8))
    assert budget.in_use == 300
    del array
    gc.collect()
    assert budget.in_use == 0 and budget.peak == 800
    charge.release()  # a second release gives nothing back twice
    assert budget.in_use == 0


def test_a_full_budget_waits_then_refuses() -> None:
    budget = DecodeBudget(1000, wait_s=0.05)
    held = budget.take(900)
    with pytest.raises(OverloadedError, match="retry shortly"):
        budget.take(200, "image bytes")
    assert budget.refused == 1 and budget.in_use == 900
    threading.Timer(0.05, held.release).start()
    budget.take(200, wait_s=5).release()  # room came while it waited
    assert budget.waited == 2 and budget.in_use == 0


def test_an_image_larger_than_the_budget_is_let_in_alone() -> None:
    budget = DecodeBudget(100, wait_s=0)
    alone = budget.take(500)
    with pytest.raises(OverloadedError):
        budget.take(1)
    alone.release()
    assert budget.take(1).nbytes == 1


def test_many_threads_never_hold_more_than_the_budget() -> None:
    images = [png(400, 300, seed) for seed in range(24)]
    one = prepare_image(images[0]).pixels.nbytes
    budget = DecodeBudget(6 * one * 16 // 3, wait_s=30)  # room for ~six decodes' peaks
    held: list[object] = []
    lock = threading.Lock()

    def work(data: bytes) -> None:
        image = prepare_image(data, budget=budget)
        with lock:
            held.append(image)
        time.sleep(0.01)
        with lock:
            held.remove(image)

    threads = [threading.Thread(target=work, args=(d,)) for d in images]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert 0 < budget.peak <= budget.limit
    assert budget.in_use == 0  # every decoded array gave its bytes back


def test_a_failed_decode_gives_its_charge_back() -> None:
    budget = DecodeBudget(1 << 30)
    broken = png(64, 64, 0)[:-40]  # truncated pixel data
    with pytest.raises(ValueError):
        prepare_image(broken, budget=budget)
    gc.collect()
    assert budget.in_use == 0


def test_the_default_is_sized_from_the_machine() -> None:
    assert 256 << 20 <= default_budget_bytes() <= 1 << 30
    with pytest.raises(ValueError):
        DecodeBudget(0)

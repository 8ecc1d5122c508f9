"""One image's crops made in parts at once (bands of the resized copy, one worker each) equal
the crops made in one piece; a lone image spreads over the cores (parts, libvips threads per
part, both sent to the workers); the pinned staging the crops of a CUDA model go through is
taken once and reused."""

from __future__ import annotations

import gc
import itertools
import json
import os
import socket
import statistics
import threading
import time
import types

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kestrel.crops import arenas as crop_arenas
from kestrel.crops import maker as crop_maker
from kestrel.crops import overlap as crops_mod
from kestrel.crops import pool as crop_pool
from kestrel.crops import procs as crop_procs
from kestrel.crops import staging as crop_staging
from kestrel.crops import worker as crop_worker
from kestrel.crops.pool import CropPool
from kestrel.crops.worker import serve
from kestrel.images import PreparedImage, prepare_image
from kestrel.moondream.config import MoondreamConfig

VISION = MoondreamConfig().vision  # Moondream 2's geometry: 378-pixel crops, up to 12
SIZES = [(960, 1280), (378, 378), (1, 1), (1, 700), (2000, 500), (733, 1111), (379, 1000)]


def _image(h: int, w: int, seed: int = 0) -> PreparedImage:
    return prepare_image(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_parts_make_exactly_the_whole(n: int) -> None:
    table = crops_mod.lut_image(np.linspace(-1, 1, 256, dtype=np.float32))
    for i, (h, w) in enumerate(SIZES):
        pixels = _image(h, w, i).pixels
        g = crops_mod.crop_geometry(h, w, VISION)
        parts = crops_mod.crop_parts(g, n, (h, w))
        assert 1 <= len(parts) <= n and sum(p.whole for p in parts) == 1
        edges = [(p.top, p.bottom) for p in parts if p.bottom > p.top]
        assert edges[0][0] == 0 and edges[-1][1] == g.resized[0]  # the rows, each once
        assert all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        for lut, dtype in ((None, np.uint8), (table, np.float32)):
            whole = np.empty((g.n_crops, g.crop, g.crop, 3), dtype)
            crops_mod.write_crops(crops_mod.vips_image(pixels), g, whole, lut)
            pieced = np.full_like(whole, 7)
            for part in parts:
                crops_mod.write_crops(crops_mod.vips_image(pixels), g, pieced, lut, part)
            assert np.array_equal(pieced, whole), (h, w, n, dtype)


@pytest.mark.parametrize(("h", "w"), [(960, 1280), (600, 800)])
def test_parts_are_balanced_by_their_modelled_work(h: int, w: int) -> None:
    """Each part's modelled work (its band's rows; the first part also the global crop) is
    equal to within the rounding of its two edges, where the global crop's work is under a
    part's share; the first part's band is then the shortest. Where it is not, the first part
    makes the global crop alone."""
    g = crops_mod.crop_geometry(h, w, VISION)
    rows, width = g.resized
    enlarged = rows > h or width > w
    per_row = width * (crops_mod.ENLARGED_BAND_PIXEL if enlarged else 1.0)
    whole = crops_mod.GLOBAL_PER_SOURCE_PIXEL * h * w + crops_mod.GLOBAL_PER_CROP_PIXEL * g.crop**2
    for n in (2, 4):
        parts = crops_mod.crop_parts(g, n, (h, w))
        work = [(whole if p.whole else 0.0) + (p.bottom - p.top) * per_row for p in parts]
        if whole >= (whole + rows * per_row) / n:
            assert parts[0].bottom == parts[0].top and len(parts) == n, (n, parts)
            continue
        assert max(work) - min(work) <= 2.001 * per_row, (n, work)
        assert parts[0].bottom - parts[0].top < parts[1].bottom - parts[1].top


def _timed(pool: CropPool, image: PreparedImage) -> tuple[float, np.ndarray]:
    t = time.perf_counter()
    crops = pool.pixels(image)
    took = time.perf_counter() - t  # the crops alone: not the test's copy of them
    # numpy's copy and comparison: torch's would leave OpenMP threads spinning on the cores
    # the next pool's workers are timed on
    return took, crops.pixels.numpy().copy()


def _alternately(pools: dict[str, CropPool], size: tuple[int, int], crops: int) -> dict:
    """Each pool's median ms over 5 images of ``size``, 3 times each, the pools taking turns
    image by image; every pool's crops checked equal to the first's."""
    times: dict[str, list[float]] = {name: [] for name in pools}
    for pool in pools.values():  # warm: the worker processes started outside the timing
        pool.pixels(_image(*size, seed=99))
    shots = [_image(*size, seed) for seed in range(5)]  # made before: no gaps in the timing
    for _ in range(3):
        for image in shots:
            made = {name: _timed(pool, image) for name, pool in pools.items()}
            want = next(iter(made.values()))[1]
            assert want.shape == (crops, 378, 378, 3)
            assert all(np.array_equal(want, got) for _, got in made.values())
            for name, (took, _) in made.items():
                times[name].append(took)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


@pytest.mark.parametrize("processes", [True, False], ids=["worker-process", "pool-thread"])
def test_one_image_in_parallel_equals_serial(processes: bool) -> None:
    """A 1280 x 960 image (a global crop and 3 x 3 local ones, shrunk) and a chart-sized
    800 x 600 one (2 x 4 local crops, enlarged: libvips's costlier path) made serially (one
    worker, one libvips thread), by one worker with a libvips thread per core, and in two parts
    at once: the same crops. The wall times are printed, measured alternately image by image
    after every pool is warm (a pool measured first, cold, looks slower than it is); the target
    is two parts <= 0.6 x serial on an idle machine; the ratio is not asserted
    (``scripts/bench_crop_parts.py`` measures it through the harness)."""
    pools = {
        "serial": CropPool(VISION, workers=1, parallel=1, threads=1, normalize=False,
                           processes=processes),
        "libvips threads": CropPool(VISION, workers=1, parallel=1, threads=2, normalize=False,
                                    processes=processes),
        "2 parts": CropPool(VISION, workers=2, parallel=2, normalize=False, processes=processes),
    }  # fmt: skip
    assert pools["2 parts"]._cropper.threads == max(1, len(os.sched_getaffinity(0)) // 2)
    try:
        for (h, w), crops in (((960, 1280), 10), ((600, 800), 9)):
            ms = _alternately(pools, (h, w), crops)
            print(f"\n{w}x{h} crops ({'processes' if processes else 'threads'}): "
                  + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
                  + f"; 2 parts / serial {ms['2 parts'] / ms['serial']:.2f}")  # fmt: skip
    finally:
        for pool in pools.values():
            pool.close()


def test_staging_is_taken_once_and_reused(monkeypatch) -> None:
    pinned_calls: list[int] = []

    def stand_in(nbytes: int) -> torch.Tensor:  # plain memory standing in for pinned
        pinned_calls.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", stand_in)
    pool = CropPool(VISION, normalize=False, pin_memory=True, prefetch=1, workers=1)
    staging = pool._cropper.staging
    assert staging is not None and staging.count == 1 + 1 + 2
    assert pinned_calls == [staging.count * 13 * 3 * 378 * 378]
    try:
        images = [_image(600, 800, seed) for seed in range(3)]
        want = [pool.pixels(im).pixels.clone() for im in images]  # each dropped: slot back
        held = [pool.pixels(im) for im in images + images[:1]]  # 4 slots, all held
        assert [h.staging is not None for h in held] == [True] * 4
        assert len({h.staging[1] for h in held if h.staging}) == 4
        extra = pool.pixels(images[1])  # none free: plain memory, same crops
        assert extra.staging is None and staging.misses == 1
        assert torch.equal(extra.pixels, want[1])
        for h, w in zip(held, want + want[:1], strict=True):
            assert torch.equal(h.pixels, w)
            assert torch.equal(
                h.encoder_input(torch.float32, "cpu"),
                crop_staging.normalize_pixels(w, torch.float32, "cpu"),
            )
        del held, h
        gc.collect()
        assert pool.pixels(images[2]).staging is not None  # slots came back
        assert len(pinned_calls) == 1  # never pinned again
    finally:
        pool.close()
    with pytest.raises(ValueError, match="uint8"):
        CropPool(VISION, normalize=True, pin_memory=True)


_NO_DATA = {"view", "slice", "select", "detach", "alias", "lift_fresh"}  # no bytes move


class _TorchOps(TorchDispatchMode):
    """The names of the aten ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("staged", [False, True], ids=["plain", "pinned-staging"])
def test_crops_are_copied_by_numpy_not_torch(monkeypatch, staged: bool) -> None:
    """An image's crops are copied out of the workers' shared memory (into pinned staging, or
    plain memory) by numpy on the calling thread, no torch op at all: a copy that size runs on
    torch's OpenMP threads, which then spin-wait on the cores the next image's crop workers
    need (measured: a 1280 x 960 image's two parts took 4.5 ms each beside them, 3.1 without;
    ``scripts/bench_crop_parts.py``)."""
    plain = crop_staging.pinned.host_empty
    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", lambda n: plain(n, pin=False))
    pool = CropPool(VISION, normalize=False, pin_memory=staged, workers=2, parallel=2)
    image = _image(600, 800)
    try:
        want = pool.pixels(image).pixels.numpy().copy()  # the workers started, the staging taken
        with _TorchOps() as seen:  # the pool's thread runs this; here, on the test's thread
            crops = pool._cropper.crop(image)
        assert pool.uses_processes == crop_procs.processes_supported()
        assert (crops.staging is not None) == staged
        assert np.array_equal(crops.pixels.numpy(), want)
        assert [op for op in seen.ops if op not in _NO_DATA] == [], seen.ops
    finally:
        pool.close()


def test_staging_made_in_inference_mode_is_written_outside_it(monkeypatch) -> None:
    """The runtime is built under ``torch.inference_mode`` (the engine's start-up) while crop
    threads and direct callers write the staging memory outside it: the memory must be a
    normal tensor, or the first staged image raises (seen on an H200)."""
    plain = crop_staging.pinned.host_empty  # the pinned allocation, less the page-locking
    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", lambda n: plain(n, pin=False))
    with torch.inference_mode():
        staging = crop_staging.CropStaging(VISION, 2)
    assert not staging._memory.is_inference()
    planes = torch.randint(0, 256, (3, 378, 378, 3), dtype=torch.uint8)
    staged = staging.stage(planes, (1, 2))  # outside inference mode, as a crop thread runs
    assert staged.staging is not None and torch.equal(staged.pixels, planes)
    with torch.inference_mode():  # and inside it, as the scheduler thread runs
        again = staging.stage(planes.flip(0), (1, 2))
    assert again.staging is not None and torch.equal(again.pixels, planes.flip(0))


@pytest.mark.parametrize(
    ("cores", "want"), [(2, (2, 1, 2)), (8, (2, 2, 4)), (16, (4, 4, 4)), (64, (4, 4, 16))]
)
def test_parts_and_threads_spread_a_lone_image_over_the_cores(monkeypatch, cores, want) -> None:
    """(workers, parts per image, libvips threads per part) by default: one part per 4 cores
    (at most the workers), each part on its share of the cores."""
    monkeypatch.setattr(crop_pool, "_cores", lambda: cores)
    pool = CropPool(VISION, processes=False)
    try:
        cropper = pool._cropper
        assert (pool._executor._max_workers, cropper.parallel, cropper.threads) == want
    finally:
        pool.close()


@pytest.mark.skipif(not crop_pool.processes_supported(), reason="needs memfd_create")
def test_the_worker_makes_a_part_on_the_threads_it_is_told(monkeypatch) -> None:
    """The request's ``threads`` sets the worker's libvips threads (run here on a thread of
    this process, whose setting is put back after)."""
    before = crops_mod.pyvips.concurrency_get()
    sent: list[bytes] = []
    monkeypatch.setattr(crop_procs._Worker, "_send", _recording_send(sent))
    pool = CropPool(VISION, normalize=False, parallel=2, threads=3)
    try:
        image = _image(300, 400)
        pool.pixels(image)
        specs = [json.loads(m.partition(b"\n")[0]) for m in sent]
        assert len(specs) == 2 and {s["threads"] for s in specs} == {3}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        thread = threading.Thread(target=serve, args=(theirs, crops_mod))
        thread.start()
        try:
            memory = crop_arenas.one_off(specs[0]["size"])
            np.frombuffer(memory.memory, np.uint8, count=image.pixels.size)[:] = (
                image.pixels.reshape(-1)
            )
            spec = {k: v for k, v in specs[0].items() if k != "arena"}
            socket.send_fds(ours, [json.dumps(spec).encode() + b"\n"], [memory.fd])
            assert ours.recv(4096) == b"ok"
            assert crops_mod.pyvips.concurrency_get() == 3
        finally:
            ours.close()
            thread.join(timeout=10)
    finally:
        pool.close()
        crops_mod.pyvips.concurrency_set(before)


@pytest.mark.skipif(not crop_pool.processes_supported(), reason="needs memfd_create")
def test_a_pyvips_without_concurrency_calls_still_makes_the_crops(monkeypatch) -> None:
    """pyvips 2.x (which the project allows) names no concurrency call: the worker sets the
    threads through libvips' own functions in pyvips' binding, and makes the crops (the staged
    GPU machine has pyvips 2.2.3; every request failed there once)."""
    want = CropPool(VISION, normalize=False, processes=False)
    image = _image(300, 400)
    try:
        expected = want.pixels(image).pixels.clone()
    finally:
        want.close()
    lib = crops_mod.pyvips.vips_lib
    before = lib.vips_concurrency_get()
    monkeypatch.delattr(crops_mod.pyvips, "concurrency_get")
    monkeypatch.delattr(crops_mod.pyvips, "concurrency_set")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sent: list[bytes] = []
    monkeypatch.setattr(crop_procs._Worker, "_send", _recording_send(sent))
    pool = CropPool(VISION, normalize=False, parallel=1, threads=2)
    thread = threading.Thread(target=serve, args=(theirs, crops_mod))
    thread.start()
    try:
        pool.pixels(image)  # records the request a worker process is sent
        spec = {k: v for k, v in json.loads(sent[0].partition(b"\n")[0]).items() if k != "arena"}
        assert spec["threads"] == 2
        memory = crop_arenas.one_off(spec["size"])
        np.frombuffer(memory.memory, np.uint8, count=image.pixels.size)[:] = image.pixels.reshape(
            -1
        )
        socket.send_fds(ours, [json.dumps(spec).encode() + b"\n"], [memory.fd])
        assert ours.recv(4096) == b"ok"
        got = np.frombuffer(memory.memory, np.uint8, count=expected.numel(), offset=spec["out"])
        assert np.array_equal(got, expected.numpy().reshape(-1))
        assert lib.vips_concurrency_get() == 2  # set through the binding
    finally:
        ours.close()
        thread.join(timeout=10)
        pool.close()
        lib.vips_concurrency_set(before)


def test_without_any_concurrency_call_the_threads_are_left_alone() -> None:
    """A pyvips whose binding lacks libvips' concurrency functions too: no call is made and
    nothing fails (libvips keeps its default threads)."""
    bare = types.SimpleNamespace(vips_lib=types.SimpleNamespace())
    assert crop_worker._concurrency_calls(bare) is None
    crop_worker._use_threads(bare, 3)  # no AttributeError
    calls: list[int] = []
    own = types.SimpleNamespace(concurrency_get=lambda: 1, concurrency_set=calls.append)
    crop_worker._use_threads(own, 3)
    crop_worker._use_threads(own, 1)  # already 1: not set again
    assert calls == [3]


def _recording_send(sent: list[bytes]):
    send = crop_procs._Worker._send

    def recording(worker, message: bytes, fd: int | None) -> None:
        sent.append(message)
        send(worker, message, fd)

    return recording


def test_core_shares_deal_the_cores_out_to_the_parts(monkeypatch) -> None:
    monkeypatch.setattr(crop_maker.os, "sched_getaffinity", lambda pid: set(range(4, 20)))
    shares = crop_maker.core_shares(4)
    assert shares == [list(range(4 + 4 * i, 8 + 4 * i)) for i in range(4)]
    assert [len(s) for s in crop_maker.core_shares(3)] == [5, 5, 6]
    assert crop_maker.core_shares(1) is None  # one part: the kernel places it
    assert crop_maker.core_shares(17) is None  # more parts than cores: likewise


@pytest.mark.skipif(
    not crop_pool.processes_supported() or len(os.sched_getaffinity(0)) < 2,
    reason="needs memfd_create and two cores",
)
def test_each_part_runs_on_its_own_cores_and_a_whole_image_on_all() -> None:
    """A lone image's parts are made by workers pinned, every thread of them, to disjoint
    shares of the cores (placed by the kernel, two parts sometimes shared a core after a
    two-thread render: 0.76-0.79x serial against 0.59-0.63x pinned), under SCHED_BATCH
    (``crop_worker.batch_policy``); a worker that then makes a whole image runs on every core
    again."""
    every = os.sched_getaffinity(0)
    parts = CropPool(VISION, normalize=False, workers=2, parallel=2)
    whole = CropPool(VISION, normalize=False, workers=1, parallel=1)
    image = _image(960, 1280)
    try:
        crop_procs.WORKERS.stop_all()  # this test's workers only
        parts.pixels(image)
        workers = list(crop_procs.WORKERS._all)
        assert len(workers) == 2
        pinned = [_thread_cores(w.proc.pid) for w in workers]
        assert all(len(p) == 1 for p in pinned), pinned  # every thread on the same share
        assert pinned[0][0] | pinned[1][0] == set(crop_maker.core_shares(2)[0]) | set(
            crop_maker.core_shares(2)[1]
        )
        assert not pinned[0][0] & pinned[1][0]
        for worker in workers:  # and under SCHED_BATCH: waking, none preempts its sender
            tids = os.listdir(f"/proc/{worker.proc.pid}/task")
            assert {os.sched_getscheduler(int(t)) for t in tids} == {os.SCHED_BATCH}
        whole.pixels(image)  # the last worker given back serves it
        assert any(_thread_cores(w.proc.pid) == [every] for w in workers)
    finally:
        parts.close()
        whole.close()


def _thread_cores(pid: int) -> list[set[int]]:
    """The distinct core sets of process ``pid``'s threads."""
    found: list[set[int]] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        cores = os.sched_getaffinity(int(tid))
        if cores not in found:
            found.append(cores)
    return found

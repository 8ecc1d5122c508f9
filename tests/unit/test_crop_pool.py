"""The crops made by crops.py and the crop pool equal the crops as they were before the pool
(the conformance goldens depend on them), through the worker process and without it; the
pool's bookkeeping: shared, released, bounded, skipped when recently encoded."""

from __future__ import annotations

import importlib
import os
import socket
import threading

import numpy as np
import pytest
import torch

from kestrel.crops import overlap as crops_mod
from kestrel.crops import pool as crop_pool
from kestrel.crops import procs as crop_procs
from kestrel.crops.overlap import CropError, overlap_crops
from kestrel.crops.pool import CropPixels, CropPool, processes_supported
from kestrel.crops.worker import serve
from kestrel.images import PreparedImage, prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.vision import normalize_pixels, pixel_table
from tests.scripts import on_path

VISION = MoondreamConfig().vision  # Moondream 2's geometry: 378-pixel crops, up to 12
SIZES = [(960, 1280), (378, 378), (1, 1), (1, 700), (2000, 500), (733, 1111), (379, 1000)]


@pytest.fixture(scope="module")
def legacy():
    with on_path():
        yield importlib.import_module("bench_crops")


def _image(h: int, w: int, seed: int = 0) -> PreparedImage:
    return prepare_image(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def test_crops_equal_the_crops_as_they_were(legacy) -> None:
    for i, (h, w) in enumerate(SIZES):
        pixels = _image(h, w, i).pixels
        old, new = legacy.legacy_overlap_crops(pixels, VISION), overlap_crops(pixels, VISION)
        assert new.tiling == old.tiling and np.array_equal(new.crops, old.crops), (h, w)
        assert not new.crops.flags.writeable
    few = overlap_crops(pixels, VISION, max_crops=2)
    assert np.array_equal(few.crops, legacy.legacy_overlap_crops(pixels, VISION, max_crops=2).crops)


def test_pixel_table_is_normalize_pixels() -> None:
    levels = torch.arange(256, dtype=torch.uint8).view(1, 1, 256, 1).expand(1, 1, 256, 3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = normalize_pixels(levels.contiguous(), dtype)[0, 0, 0]
        assert torch.equal(torch.from_numpy(pixel_table()).to(dtype), want)


@pytest.mark.parametrize("processes", [True, False], ids=["worker-process", "pool-thread"])
def test_pool_pixels_equal_normalized_crops(legacy, processes) -> None:
    pools = [CropPool(VISION, processes=processes, normalize=n) for n in (True, False)]
    try:
        assert pools[0].uses_processes == (processes and processes_supported())
        for i, (h, w) in enumerate([(960, 1280), (1, 1), (2000, 500)]):
            image = _image(h, w, i)
            old = legacy.legacy_overlap_crops(image.pixels, VISION)
            floats, uint8 = (pool.pixels(image) for pool in pools)
            assert floats.tiling == uint8.tiling == old.tiling
            assert floats.pixels.dtype == torch.float32 and uint8.pixels.dtype == torch.uint8
            assert np.array_equal(uint8.pixels.numpy(), old.crops)  # channels last, as made
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                want = normalize_pixels(old.crops, dtype)
                assert torch.equal(floats.encoder_input(dtype, "cpu"), want), (h, w, dtype)
                assert torch.equal(uint8.encoder_input(dtype, "cpu"), want), (h, w, dtype)
    finally:
        for pool in pools:
            pool.close()


def test_bad_pixels_raise_crop_error() -> None:
    pool = CropPool(VISION)
    bad = PreparedImage(np.zeros((4, 4, 3), np.float32), b"\0" * 32)
    with pytest.raises(CropError, match="uint8"):
        pool.pixels(bad)
    black = prepare_image(np.zeros((50, 50, 3), np.uint8))
    assert torch.equal(pool.pixels(black).pixels, -torch.ones(2, 378, 378, 3))  # still serving
    pool.close()


def test_worker_reports_errors_and_keeps_serving() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    thread = threading.Thread(target=serve, args=(theirs, crops_mod))
    thread.start()
    try:
        r, w = os.pipe()
        socket.send_fds(ours, [b"not json\n"], [r])
        assert ours.recv(4096).startswith(b"error: JSONDecodeError")
        os.close(w)
    finally:
        ours.close()
        thread.join(timeout=10)
    assert not thread.is_alive()  # the other end closed: it returned


@pytest.mark.skipif(not processes_supported(), reason="needs memfd_create")
@pytest.mark.parametrize("parallel", [1, 3])
def test_a_dead_worker_is_replaced(legacy, parallel: int) -> None:
    """Killed worker processes are let go when next taken: the image after is made by new
    ones, whatever the parts per image (each part needs a worker of its own)."""
    pool = CropPool(VISION, parallel=parallel)
    image = _image(400, 500)
    want = normalize_pixels(legacy.legacy_overlap_crops(image.pixels, VISION).crops, torch.float32)
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
    for worker in list(crop_pool._WORKERS._all):
        worker.proc.kill()
        worker.proc.wait()
    dead = set(crop_pool._WORKERS._all)
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
    assert pool.uses_processes and pool._cropper.failures == 0  # no part was made here
    assert not dead & crop_pool._WORKERS._all  # every killed worker let go
    pool.close()


@pytest.mark.skipif(not processes_supported(), reason="needs memfd_create")
def test_a_worker_lost_mid_request_is_let_go_and_the_crops_made_here(legacy, monkeypatch) -> None:
    pool = CropPool(VISION, parallel=2)
    image = _image(400, 500)
    want = normalize_pixels(legacy.legacy_overlap_crops(image.pixels, VISION).crops, torch.float32)
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
    finish, lost = crop_procs._Worker.finish, []

    def lose_one(worker: crop_procs._Worker) -> None:
        finish(worker)  # the part is made, then the reply "lost"
        if not lost:
            lost.append(worker)
            raise crop_procs.WorkerGone("the crop worker process exited")

    monkeypatch.setattr(crop_procs._Worker, "finish", lose_one)
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)  # made here
    assert pool._cropper.failures == 1 and lost[0] not in crop_pool._WORKERS._all
    assert lost[0].proc.poll() is not None  # stopped
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
    assert pool._cropper.failures == 0 and pool.uses_processes
    pool.close()


class Recorder:
    """Stands in for the cropper: counts crops per image, optionally held at a gate."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()

    def crop(self, image: PreparedImage, lone: bool = True) -> CropPixels:
        self.gate.wait(10)
        self.calls.append(image.digest)
        return CropPixels(torch.zeros(1), (1, 1))

    def close(self) -> None:
        """The pool closes its cropper (which has no threads of its own here)."""


def _recording_pool(**kw) -> tuple[CropPool, Recorder]:
    pool = CropPool(VISION, processes=False, **kw)
    rec = Recorder()
    pool._cropper = rec  # type: ignore[assignment]
    return pool, rec


def test_holds_share_release_and_bound_the_prefetch() -> None:
    pool, rec = _recording_pool(prefetch=1, workers=1)
    a, b = _image(10, 10, 1), _image(10, 10, 2)
    rec.gate.clear()
    h1, h2, h3 = pool.hold([a]), pool.hold([a]), pool.hold([b])
    started = {d: e.future is not None for d, e in pool._entries.items()}
    assert started == {a.digest: True, b.digest: False}  # b waits for a prefetch slot
    rec.gate.set()
    pool.pixels(a)  # taken: b starts
    assert pool._entries[b.digest].future is not None
    h1.release()
    h2.release()
    h2.release()  # idempotent
    pool.pixels(b)
    h3.release()
    assert rec.calls == [a.digest, b.digest] and pool._entries == {}
    released = pool.hold([a])
    released.release()
    assert a.digest not in pool._entries
    pool.close()


def test_recently_encoded_images_are_skipped_and_close_crops_in_place() -> None:
    pool, rec = _recording_pool(recent=1)
    a, b = _image(10, 10, 1), _image(10, 10, 2)
    pool.pixels(a)
    with pool.hold([a], skip_recent=True):
        assert a.digest not in pool._entries  # likely a cache hit: no crops
    with pool.hold([a]):
        assert a.digest in pool._entries  # the runtime's hold never skips
    pool.pixels(b)  # only one remembered: a is forgotten
    with pool.hold([a], skip_recent=True):
        assert a.digest in pool._entries
    pool.close()
    pool.pixels(a)  # closed: made on this thread
    assert rec.calls.count(a.digest) >= 2
    with pytest.raises(ValueError, match="prefetch"):
        CropPool(VISION, prefetch=0)


@pytest.mark.skipif(not processes_supported(), reason="needs memfd_create")
def test_workers_started_ahead_serve_the_first_requests(monkeypatch) -> None:
    """``start_workers`` starts the processes a pool keeps busy (threads x parts) on a thread
    of its own (their imports take ~80 ms: no request should wait for them); ``ensure`` tops
    up, never past its count."""
    crop_pool._WORKERS.stop_all()
    assert crop_procs.WORKERS.ensure(2) == 2 and crop_procs.WORKERS.ensure(2) == 0
    crop_pool._WORKERS.stop_all()
    thread = crop_pool.start_workers(2, 2)
    assert thread is not None and thread.name == "kestrel-crops-start"
    thread.join(timeout=30)
    assert len(crop_pool._WORKERS._all) == 4 and len(crop_pool._WORKERS._idle) == 4
    started: list[crop_procs._Worker] = []
    real_init = crop_procs._Worker.__init__

    def counted(worker: crop_procs._Worker) -> None:
        started.append(worker)
        real_init(worker)

    monkeypatch.setattr(crop_procs._Worker, "__init__", counted)
    pool = CropPool(VISION, workers=2, parallel=2)
    try:
        for seed in range(3):
            pool.pixels(_image(300, 400, seed))
        assert started == []  # every part went to a worker started ahead
    finally:
        pool.close()


@pytest.mark.parametrize(("device", "want"), [("cuda", ["workers", "load"]), ("cpu", ["load"])])
def test_the_engine_starts_the_crop_workers_before_it_loads_a_cuda_model(
    monkeypatch, device: str, want: list[str]
) -> None:
    from kestrel.engine import setup

    order: list[str] = []
    monkeypatch.setattr(setup, "resolve_device", lambda _: torch.device(device))
    monkeypatch.setattr(setup, "start_workers", lambda: order.append("workers"))

    def load(*args, **kwargs):
        order.append("load")
        raise OSError("stop here")

    with setup.model_loader(load), pytest.raises(setup.ModelLoadError, match="stop here"):
        setup.load_runtime(None, device=device, dtype=None, kv_cache_pages=None,
                           max_batch_size=1, enable_prefix_cache=True,
                           attention_backend="auto")  # fmt: skip
    assert order == want


@pytest.mark.skipif(not processes_supported(), reason="needs memfd_create")
def test_a_worker_that_answers_with_an_error_fails_no_request(legacy, monkeypatch) -> None:
    """A worker that answers with an error (on an H200 once, every request: its pyvips lacked a
    call the worker made) fails no request: the crops are made here and the worker is kept;
    after three such answers in a row the pool makes its crops here from then on."""
    pool = CropPool(VISION, parallel=1)
    image = _image(400, 500)
    want = normalize_pixels(legacy.legacy_overlap_crops(image.pixels, VISION).crops, torch.float32)
    recv = crop_procs._Worker._recv
    reply = b"error: AttributeError: module 'pyvips' has no attribute 'concurrency_get'"
    monkeypatch.setattr(crop_procs._Worker, "_recv", lambda w: recv(w) and reply)
    for failures in (1, 2):
        assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
        assert pool._cropper.failures == failures and pool.uses_processes
    kept = set(crop_pool._WORKERS._all)
    assert kept and all(w.proc.poll() is None for w in kept)
    assert torch.equal(pool.pixels(image).encoder_input(torch.float32, "cpu"), want)
    assert not pool.uses_processes and kept <= crop_pool._WORKERS._all
    pool.close()

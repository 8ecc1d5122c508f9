"""The shared-memory arenas the crop worker processes write into: taken and given back,
grown by generation, refused over the limit; a worker maps an arena once and reuses the
mapping, and says so when it has not mapped one; a pool with staging (a CUDA model's) makes
the same crops through them as in-process, sending each worker an arena's descriptor once."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest
import torch

from kestrel.images import prepare_image
from kestrel.moondream import crops as crops_mod
from kestrel.moondream.config import MoondreamConfig
from kestrel.runtime import crop_arenas, crop_maker, crop_procs, crop_staging
from kestrel.runtime.crop_pool import CropPool, processes_supported
from kestrel.runtime.crop_worker import NOT_MAPPED, serve

VISION = MoondreamConfig().vision
needs_memfd = pytest.mark.skipif(not processes_supported(), reason="needs memfd_create")


@needs_memfd
def test_arenas_are_reused_grown_and_bounded() -> None:
    arenas = crop_arenas.Arenas(slots=2, max_bytes=8 << 20)
    a = arenas.take(1000)
    assert a is not None and a.size >= 1000 and a.generation == 1
    arenas.give(a)
    again = arenas.take(5000)  # fits: the same file, the same generation
    assert again is a and arenas.made == 1
    b = arenas.take(10)
    assert b is not None and b.slot != a.slot and arenas.take(10) is None  # both taken
    arenas.give(b)
    arenas.give(again)
    grown = arenas.take(3 << 20)  # more than the first file: the slot's next generation
    assert grown is not None and grown.size >= 3 << 20 and grown.generation == 2
    assert arenas.take(9 << 20) is None  # over the limit: the caller makes a file of its own
    arenas.give(grown)
    arenas.close()


@needs_memfd
def test_worker_maps_an_arena_once_and_asks_for_a_missing_one() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    thread = threading.Thread(target=serve, args=(theirs, crops_mod))
    thread.start()
    arena = crop_arenas.one_off(1 << 20, slot=3)
    try:
        pixels = np.random.default_rng(0).integers(0, 256, (40, 50, 3), np.uint8)
        g = crops_mod.crop_geometry(40, 50, VISION)
        np.frombuffer(arena.memory, np.uint8, count=pixels.size)[:] = pixels.reshape(-1)
        fields = {k: getattr(g, k) for k in ("crop", "margin", "window", "rows", "cols")}
        out = (pixels.size + 63) // 64 * 64
        spec = {"size": arena.size, "height": 40, "width": 50, "out": out, "geometry": fields}
        message = json.dumps({**spec, "arena": [3, 1]}).encode() + b"\n"
        ours.sendall(message)
        assert ours.recv(4096) == NOT_MAPPED  # never given the descriptor
        socket.send_fds(ours, [message], [arena.fd])
        assert ours.recv(4096) == b"ok"
        count = g.n_crops * 3 * g.crop * g.crop
        made = np.frombuffer(arena.memory, np.uint8, count=count, offset=out).copy()
        want = np.empty((g.n_crops, g.crop, g.crop, 3), np.uint8)
        crops_mod.write_crops(crops_mod.vips_image(pixels), g, want)
        assert np.array_equal(made.reshape(want.shape), want)
        np.frombuffer(arena.memory, np.uint8, count=count, offset=out)[:] = 0
        ours.sendall(message)  # no descriptor: the worker's mapping of generation 1
        assert ours.recv(4096) == b"ok"
        assert np.array_equal(
            np.frombuffer(arena.memory, np.uint8, count=count, offset=out), want.reshape(-1)
        )
        ours.sendall(json.dumps({**spec, "arena": [3, 2]}).encode() + b"\n")
        assert ours.recv(4096) == NOT_MAPPED  # a later generation: not this mapping
    finally:
        ours.close()
        thread.join(timeout=10)
        arena.close()
    assert not thread.is_alive()


@needs_memfd
def test_staged_pool_crops_through_arenas(monkeypatch) -> None:
    arenas = crop_arenas.Arenas(slots=4)
    monkeypatch.setattr(crop_maker, "ARENAS", arenas)
    monkeypatch.setattr(
        crop_staging.pinned, "pinned_empty", lambda n: torch.empty(n, dtype=torch.uint8)
    )
    sends = []
    real_send_fds = crop_procs.socket.send_fds

    def counted(sock, buffers, fds, *args):  # this pool's arenas' descriptors only
        head = json.loads(bytes(buffers[0]).partition(b"\n")[0])
        if head.get("arena", [None])[0] in arenas.slots:
            sends.append(len(fds))
        return real_send_fds(sock, buffers, fds, *args)

    monkeypatch.setattr(crop_procs.socket, "send_fds", counted)
    pool = CropPool(VISION, normalize=False, pin_memory=True, workers=2, parallel=2)
    rng = np.random.default_rng(1)
    sizes = [(600, 800), (960, 1280), (600, 800), (960, 1280), (2000, 1500), (600, 800)]
    try:
        for h, w in sizes:
            image = prepare_image(rng.integers(0, 256, (h, w, 3), np.uint8))
            g = crops_mod.crop_geometry(h, w, VISION)
            want = np.empty((g.n_crops, g.crop, g.crop, 3), np.uint8)
            crops_mod.write_crops(crops_mod.vips_image(image.pixels), g, want)
            got = pool.pixels(image)
            assert got.staging is not None and torch.equal(got.pixels, torch.from_numpy(want))
            del got
    finally:
        pool.close()
    requests = len(sizes) * 2  # two parts an image, one worker each
    workers = len(crop_procs.WORKERS._all)  # this pool's two, and any other test's left idle
    assert arenas.made <= 3  # one file, grown at most twice (the larger images)
    assert 0 < len(sends) <= workers * arenas.made  # a descriptor per worker and file, once
    assert len(sends) < requests


@needs_memfd
def test_float_crops_go_through_an_arena_and_are_copied_out(monkeypatch) -> None:
    """A CPU model's float32 crops use the arenas too (a file per image costs more in fresh
    pages than the copy): no file of their own, and crops handed out never change when the
    arena is reused for the next image."""
    arenas = crop_arenas.Arenas(slots=2)
    monkeypatch.setattr(crop_maker, "ARENAS", arenas)
    files: list[int] = []
    real_one_off = crop_maker.one_off
    monkeypatch.setattr(
        crop_maker, "one_off", lambda size: files.append(size) or real_one_off(size)
    )
    pool = CropPool(VISION, normalize=True, workers=1)
    rng = np.random.default_rng(2)
    try:
        made = []
        for h, w in [(960, 1280), (600, 800), (960, 1280)]:
            image = prepare_image(rng.integers(0, 256, (h, w, 3), np.uint8))
            got = pool.pixels(image)
            made.append((got, got.pixels.clone(), image))
        for got, copy, image in made:
            assert torch.equal(got.pixels, copy)  # not overwritten by a later image
            g = crops_mod.crop_geometry(*image.pixels.shape[:2], VISION)
            want = np.empty((g.n_crops, g.crop, g.crop, 3), np.float32)
            table = crops_mod.lut_image(crop_maker.pixel_table())
            crops_mod.write_crops(crops_mod.vips_image(image.pixels), g, want, table)
            assert torch.equal(got.pixels, torch.from_numpy(want))
    finally:
        pool.close()
    assert files == [] and arenas.made == 1

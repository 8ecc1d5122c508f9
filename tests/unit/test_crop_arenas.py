"""The shared-memory arenas the crop worker processes write into: taken and given back,
grown by generation, refused over the limit; a worker maps an arena once and reuses the
mapping, and says so when it has not mapped one; a pool with staging (a CUDA model's) makes
the same crops through them as in-process, sending each worker an arena's descriptor once."""

from __future__ import annotations

import gc
import json
import socket
import threading

import numpy as np
import pytest
import torch

from kestrel.crops import arenas as crop_arenas
from kestrel.crops import maker as crop_maker
from kestrel.crops import overlap as crops_mod
from kestrel.crops import procs as crop_procs
from kestrel.crops import staging as crop_staging
from kestrel.crops.pool import CropPool, processes_supported
from kestrel.crops.worker import NOT_MAPPED, serve
from kestrel.images import prepare_image
from kestrel.moondream.config import MoondreamConfig

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
def test_crops_are_lent_with_their_arena_until_the_last_view_is_gone(monkeypatch) -> None:
    """A CPU model's float32 crops (and uint8 crops with no staging) are not copied out of
    their arena: it is lent with them and comes back only when no tensor or view over that
    memory is left, so crops handed out never change while anything reads them. With every
    arena lent, an image gets a file of its own; once the crops go, the arenas are reused."""
    arenas = crop_arenas.Arenas(slots=2)
    monkeypatch.setattr(crop_maker, "ARENAS", arenas)
    files: list[int] = []
    real_one_off = crop_maker.one_off
    monkeypatch.setattr(
        crop_maker, "one_off", lambda size: files.append(size) or real_one_off(size)
    )
    pool = CropPool(VISION, normalize=True, workers=1)
    rng = np.random.default_rng(2)
    table = crops_mod.lut_image(crop_maker.pixel_table())
    try:
        made = []
        for h, w in [(960, 1280), (600, 800), (960, 1280)]:
            image = prepare_image(rng.integers(0, 256, (h, w, 3), np.uint8))
            got = pool.pixels(image)
            made.append((got.pixels[1:], got.pixels.clone(), image))  # a view, kept
            del got
        assert len(files) == 1 and arenas.made == 2  # two lent, the third in a file
        for view, copy, image in made:
            assert torch.equal(view, copy[1:])  # not overwritten by a later image
            g = crops_mod.crop_geometry(*image.pixels.shape[:2], VISION)
            want = np.empty((g.n_crops, g.crop, g.crop, 3), np.float32)
            crops_mod.write_crops(crops_mod.vips_image(image.pixels), g, want, table)
            assert torch.equal(copy, torch.from_numpy(want))
        assert arenas.take(1) is None  # both still lent: the views read them
        del made, view
        gc.collect()
        for h, w in [(600, 800), (960, 1280)]:
            image = prepare_image(rng.integers(0, 256, (h, w, 3), np.uint8))
            pool.pixels(image)  # dropped at once: its arena back before the next image
        assert len(files) == 1 and arenas.made == 2  # the lent arenas came back and served
    finally:
        pool.close()


class _Served:
    """``serve`` on a thread of this process, over one arena (slot 5), counting the libvips
    pipelines it builds."""

    def __init__(self, monkeypatch) -> None:
        self.built: list[crops_mod.CropPart | None] = []
        real = crops_mod.part_renders

        def counted(image, g, lut=None, part=None):
            if threading.current_thread() is self.thread:  # the worker's, not the test's
                self.built.append(part)
            return real(image, g, lut, part)

        monkeypatch.setattr(crops_mod, "part_renders", counted)
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.thread = threading.Thread(target=serve, args=(theirs, crops_mod))
        self.thread.start()
        self.arena = crop_arenas.one_off(32 << 20, slot=5)
        self.generation = 1
        self.mapped = False

    def crops(self, pixels: np.ndarray, table: np.ndarray | None = None, part=None) -> np.ndarray:
        """The worker's crops of ``pixels`` (the whole, or ``part`` of them, the rest zero)."""
        h, w = pixels.shape[:2]
        g = crops_mod.crop_geometry(h, w, VISION)
        np.frombuffer(self.arena.memory, np.uint8, count=pixels.size)[:] = pixels.reshape(-1)
        out = (pixels.size + 63) // 64 * 64
        dtype = np.float32 if table is not None else np.uint8
        made = np.frombuffer(self.arena.memory, dtype, count=g.n_crops * 3 * g.crop**2, offset=out)
        made[:] = 0
        fields = {k: getattr(g, k) for k in ("crop", "margin", "window", "rows", "cols")}
        spec = {"size": self.arena.size, "height": h, "width": w, "out": out, "geometry": fields,
                "arena": [5, self.generation]}  # fmt: skip
        if part is not None:
            spec["part"] = [part.whole, part.top, part.bottom]
        message = (
            json.dumps(spec).encode() + b"\n" + (table.tobytes() if table is not None else b"")
        )
        if self.mapped:
            self.ours.sendall(message)
        else:
            socket.send_fds(self.ours, [message], [self.arena.fd])
            self.mapped = True
        reply = self.ours.recv(4096)
        assert reply == b"ok", reply
        return made.reshape(g.n_crops, g.crop, g.crop, 3).copy()

    def close(self) -> None:
        self.ours.close()
        self.thread.join(timeout=10)
        self.arena.close()
        assert not self.thread.is_alive()


def _want(pixels: np.ndarray, table: np.ndarray | None = None, part=None) -> np.ndarray:
    g = crops_mod.crop_geometry(*pixels.shape[:2], VISION)
    want = np.zeros((g.n_crops, g.crop, g.crop, 3), np.float32 if table is not None else np.uint8)
    lut = crops_mod.lut_image(table) if table is not None else None
    crops_mod.write_crops(crops_mod.vips_image(pixels), g, want, lut, part)
    return want


@needs_memfd
def test_worker_renders_its_kept_pipelines_over_each_new_image(monkeypatch) -> None:
    """A worker builds an image size's libvips pipelines once per arena and renders them again
    over every later image of that size there: each image's crops exactly libvips' own (uint8
    and float32, whole and in parts), never an earlier image's. A new size, a pixel table or a
    part builds its own; the arena mapped again (its next generation) builds them anew."""
    served = _Served(monkeypatch)
    rng = np.random.default_rng(3)
    table = np.linspace(-1, 1, 256, dtype=np.float32)
    try:
        shots = [rng.integers(0, 256, (600, 800, 3), np.uint8) for _ in range(3)]
        for pixels in shots:
            assert np.array_equal(served.crops(pixels), _want(pixels))
        assert len(served.built) == 1  # built for the first image, rendered for all three
        for pixels in shots[:2]:
            assert np.array_equal(served.crops(pixels, table), _want(pixels, table))
        g = crops_mod.crop_geometry(600, 800, VISION)
        for part in crops_mod.crop_parts(g, 2, (600, 800)):
            for pixels in shots[1:]:
                got = served.crops(pixels, part=part)
                assert np.array_equal(got, _want(pixels, part=part))
        assert len(served.built) == 1 + 1 + 2  # the table's, each part's: once each
        other = rng.integers(0, 256, (960, 1280, 3), np.uint8)
        assert np.array_equal(served.crops(other), _want(other))  # a new size: built
        assert np.array_equal(served.crops(shots[0]), _want(shots[0]))  # kept still
        assert len(served.built) == 5
        served.generation, served.mapped = 2, False  # the slot's file replaced
        assert np.array_equal(served.crops(shots[2]), _want(shots[2]))
        assert len(served.built) == 6
    finally:
        served.close()


@needs_memfd
def test_a_render_that_fails_is_not_kept(monkeypatch) -> None:
    served = _Served(monkeypatch)
    pixels = np.random.default_rng(4).integers(0, 256, (300, 400, 3), np.uint8)
    real = crops_mod.write_part
    fail = [True]

    def failing(renders, g, out):
        if fail.pop() if fail else False:
            raise RuntimeError("libvips failed")
        return real(renders, g, out)

    monkeypatch.setattr(crops_mod, "write_part", failing)
    try:
        with pytest.raises(AssertionError, match="libvips failed"):
            served.crops(pixels)
        assert np.array_equal(served.crops(pixels), _want(pixels))  # built again, not reused
        assert np.array_equal(served.crops(pixels), _want(pixels))  # now kept
        assert len(served.built) == 2
    finally:
        served.close()

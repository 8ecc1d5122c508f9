"""Crops made where the encoder runs (``CropPool(on_device=True)``, the CUDA default), proved on
the CPU: the pool hands out the image itself with its plan, the encoder's input is the host
crops' to the bit, images larger than a staging slot, and images that arrive while others'
crops are in the making, are cropped on the host, a runtime that
makes them so gives the same logits and answers as one that does not, and writes them into
the vision encoder's own input buffer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kestrel import Engine
from kestrel.crops import device as device_crops
from kestrel.crops import maker as crop_maker
from kestrel.crops import staging as crop_staging
from kestrel.crops.pool import CropPool
from kestrel.errors import InvalidInputError
from kestrel.images import prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.runtime.vision_graphs import VisionGraphs
from tests.integration.conftest import FIXTURE_MODEL, GREEDY, assert_idle, text_tokens

VISION = MoondreamConfig().vision


@pytest.mark.parametrize("size", [(600, 800), (960, 1280), (700, 500), (2000, 500)])
def test_the_pool_hands_out_the_image_and_the_encoder_gets_the_host_crops(size) -> None:
    image = prepare_image(np.random.default_rng(1).integers(0, 256, (*size, 3), np.uint8))
    device = CropPool(VISION, normalize=False, on_device=True, processes=False)
    host = CropPool(VISION, normalize=False, processes=False)
    try:
        made, expected = device.pixels(image), host.pixels(image)
        assert made.plan is not None and tuple(made.pixels.shape) == (*size, 3)
        assert made.tiling == expected.tiling
        for dtype in (torch.float32, torch.bfloat16):
            got = made.encoder_input(dtype, "cpu")
            want = expected.encoder_input(dtype, "cpu")
            assert got.dtype == dtype and torch.equal(got, want)
    finally:
        device.close()
        host.close()


def test_device_crops_need_uint8_crops() -> None:
    with pytest.raises(ValueError, match="uint8"):
        CropPool(VISION, normalize=True, on_device=True)


def test_a_runtime_with_device_crops_answers_as_one_without(make_runtime, model, images) -> None:
    t = model.config.tokenizer
    prompt = text_tokens([t.bos_id, *t.templates["query"]["prefix"], 302, 333, 272,
                          t.answer_id, t.answer_id])  # fmt: skip
    answers = {}
    for on in (False, True):
        rt = make_runtime(device_crops=on, enable_prefix_cache=False)
        assert rt.crops.on_device is on
        for name in ("scene_800x600", "shapes_378"):
            state, logits = rt.start_sequence(prompt, images[name], max_new_tokens=4)
            ids = [int(logits.argmax())]
            for _ in range(3):
                ids.append(int(rt.decode_step([state], [text_tokens([ids[-1]])[0]])[0].argmax()))
            answers[on, name] = (logits, ids)
            rt.release_sequence(state)
        assert rt.counters.encoder_runs == 2
    for name in ("scene_800x600", "shapes_378"):
        (a, ids_a), (b, ids_b) = answers[False, name], answers[True, name]
        assert torch.equal(a, b) and ids_a == ids_b  # the same pixels: the same floats


@pytest.mark.parametrize(("backend", "writes"), [("torch", 1), ("triton", 0)],
                         ids=["matrix-products", "kernel"])  # fmt: skip
def test_device_crops_land_in_the_encoders_own_buffer(make_runtime, model, images, backend,
                                                      writes, monkeypatch) -> None:  # fmt: skip
    """With the vision graphs (a stand-in replay for the captured encoder), crops cut on the
    device go into the crop count's input buffer and the encoder reads them there:
    the kernel writes it itself (no copy at all), the matrix products' path with one copy (its
    own); the encoder copies nothing. The embedding is the host crops'."""
    if backend == "triton":  # the kernel, interpreted; the encoder's fused ops stay torch's
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(device_crops, "_kernel_runs", lambda device: True)
        monkeypatch.setattr(crop_maker, "device_disagrees", lambda *args: None)  # tested apart
    image = prepare_image(images["shapes_378"])  # 2 crops: quick to interpret
    embeddings, copies = {}, []
    real_copy = torch.Tensor.copy_
    for on in (False, True):
        rt = make_runtime(device_crops=on, enable_prefix_cache=False)
        rt.vision_graphs = graphs = VisionGraphs(model, capture=False)
        bucket = graphs._buckets[2]
        bucket.graph = _Replay(graphs, bucket)  # the replay path, as if captured
        buffer = graphs.input_buffer(2, rt.dtype)
        copies.clear()
        monkeypatch.setattr(torch.Tensor, "copy_", _watching(real_copy, buffer, copies))
        with torch.inference_mode():
            embeddings[on] = rt.encode_image(image)
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        if on:
            want = rt.crops.pixels(image).encoder_input(rt.dtype, "cpu")
            assert torch.equal(buffer, want) and sum(copies) == writes, copies
        assert graphs.replays == 1
    assert torch.equal(embeddings[False], embeddings[True])


class _Replay:
    """A captured encoder's stand-in: a replay runs it on the bucket's input buffer."""

    def __init__(self, graphs: VisionGraphs, bucket) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.bucket.features = self.graphs._encoder(self.bucket.pixels_NCHW)


def _watching(real_copy, buffer: torch.Tensor, copies: list[bool]):
    """``Tensor.copy_`` that notes whether each copy writes ``buffer``."""

    def copy_(t, src, *args, **kwargs):
        copies.append(t.data_ptr() == buffer.data_ptr())
        return real_copy(t, src, *args, **kwargs)

    return copy_


def test_staged_images_take_a_slot_and_larger_ones_are_cropped_on_the_host(monkeypatch) -> None:
    plain = crop_staging.pinned.host_empty  # the pinned allocation, less the page-locking
    monkeypatch.setattr(crop_staging.pinned, "pinned_empty", lambda n: plain(n, pin=False))
    pool = CropPool(VISION, normalize=False, pin_memory=True, on_device=True, processes=False)
    host = CropPool(VISION, normalize=False, processes=False)
    try:
        small = prepare_image(np.random.default_rng(2).integers(0, 256, (600, 800, 3), np.uint8))
        large = prepare_image(np.random.default_rng(3).integers(0, 256, (1500, 1400, 3), np.uint8))
        staged = pool.pixels(small)
        assert staged.staging is not None and staged.plan is not None
        assert staged.pixels.shape == (600, 800, 3)  # the image itself, in a slot
        cut = pool.pixels(large)  # 6.3 MB: more than a slot's 13 crops; its crops fit one
        assert cut.staging is not None and cut.plan is None and cut.pixels.shape[0] == 1 + 3 * 3
        for crops, image in ((staged, small), (cut, large)):
            want = host.pixels(image).encoder_input(torch.float32, "cpu")
            assert torch.equal(crops.encoder_input(torch.float32, "cpu"), want)
    finally:
        pool.close()
        host.close()


def test_under_a_backlog_the_host_makes_the_crops(monkeypatch) -> None:
    """A lone image goes to the device; images submitted while another's crops are still in
    the making are cut by the host's workers (beside the GPU's work), to the same bytes."""
    release = threading.Event()
    real = crop_maker.Cropper._for_device

    def held_back(self, pixels, size):
        release.wait(10)  # the first image's crops stay in the making
        return real(self, pixels, size)

    monkeypatch.setattr(crop_maker.Cropper, "_for_device", held_back)
    pool = CropPool(VISION, normalize=False, on_device=True, processes=False, workers=3)
    host = CropPool(VISION, normalize=False, processes=False)
    rng = np.random.default_rng(4)
    images = [prepare_image(rng.integers(0, 256, (480, 640, 3), np.uint8)) for _ in range(3)]
    try:
        # the later two are submitted while the first is held back
        with pool.hold(images[:1]), pool.hold(images[1:]):
            release.set()
            made = [pool.pixels(image) for image in images]
        assert [m.plan is not None for m in made] == [True, False, False]
        for crops, image in zip(made, images, strict=True):
            want = host.pixels(image).encoder_input(torch.float32, "cpu")
            assert torch.equal(crops.encoder_input(torch.float32, "cpu"), want)
    finally:
        release.set()
        pool.close()
        host.close()


def test_the_engine_takes_device_crops_and_answers_the_same(images) -> None:
    with pytest.raises(InvalidInputError, match="device_crops"):
        Engine(FIXTURE_MODEL, device="cpu", device_crops="yes")
    answers = {}
    for on in (None, True):
        with Engine(FIXTURE_MODEL, device="cpu", dtype="float32", device_crops=on) as engine:
            assert engine.runtime.crops.on_device is bool(on)  # a CPU: only when asked
            answers[on] = [engine.query(images[name], "What is this?", settings=GREEDY).answer
                           for name in ("scene_800x600", "tall_300x1000")]  # fmt: skip
            assert_idle(engine)
    assert answers[None] == answers[True]

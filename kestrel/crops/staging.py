"""An image's crops on the host (``CropPixels``) and the pinned memory they are staged in.

On CUDA the crops are uploaded from page-locked memory, so the upload needs no host sync. That
memory is taken once, when the crop pool is made (start-up), as ``CropStaging``: ``count``
slots, each big enough for the most crops an image can have. A crop thread takes a free slot
and copies an image's crops in; the crops give the slot back when they are gone (garbage
collected), and the slot is reused once the upload queued from it (a CUDA event) has run.
Nothing is pinned per image, so no crop thread ever calls into the driver while the scheduler
thread might capture a CUDA graph. With every slot in use, the crops stay in plain memory and
their upload waits for the copy (``misses`` counts those). Where the GPU makes the crops
(``device.py``) a slot holds the image itself instead, when it fits (an image
of up to a slot's bytes: ~1.86 million pixels for Moondream 2).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kestrel.crops.device import encoder_crops
from kestrel.crops.resample import CropPlan
from kestrel.moondream.config import VisionConfig
from kestrel.moondream.vision import normalize_pixels
from kestrel_kernels import pinned

__all__ = ["CropPixels", "CropStaging"]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class CropPixels:
    """An image's crops on the host, channels last [N, crop, crop, 3] as libvips makes them:
    normalized float32, or uint8 to be normalized on the device; ``tiling`` = (rows, cols).
    ``staging``: the slot of pinned memory ``pixels`` lies in (None: plain memory). With a
    ``plan`` ``pixels`` is the image itself (uint8 [H, W, 3]), cropped on the device
    (``device.encoder_crops``: the same bytes)."""

    pixels: torch.Tensor
    tiling: tuple[int, int]
    staging: tuple[CropStaging, int] | None = None
    plan: CropPlan | None = None

    def encoder_input(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        buffer: Callable[[int, torch.dtype], torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The vision encoder's input: normalized, in ``dtype`` on ``device`` (uploaded without
        a host sync when the crops are staged in pinned memory). Crops made on the device are
        written into ``buffer(n_crops, dtype)`` where that gives a tensor (the encoder's own
        input: ``VisionGraphs.input_buffer``)."""
        device = torch.device(device)
        to_cuda = device.type == "cuda" and self.staging is not None
        pixels = self.pixels.to(device=device, non_blocking=to_cuda)
        if to_cuda and self.staging is not None:
            staging, slot = self.staging
            staging.uploaded(slot)
        if self.plan is not None:  # the image: cut and normalized where it now is
            out = buffer(self.plan.geometry.n_crops, dtype) if buffer is not None else None
            if out is not None and out.device != pixels.device:
                out = None
            return encoder_crops(pixels, self.plan, dtype, out)
        if pixels.dtype == torch.uint8:  # the same arithmetic, on the device
            return normalize_pixels(pixels, dtype, device)
        # a view: the encoder's patch cut (``vision.patchify``) copies it into patches anyway
        return pixels.permute(0, 3, 1, 2).to(dtype=dtype)


class CropStaging:
    """``count`` slots of pinned memory for one vision config's uint8 crops (module doc)."""

    def __init__(self, config: VisionConfig, count: int) -> None:
        if count < 1:
            raise ValueError(f"crop staging needs at least one slot, got {count}")
        self.max_crops = 1 + config.max_crops
        self.crop = config.crop_size
        self.slot_bytes = self.max_crops * 3 * self.crop * self.crop
        self._memory = pinned.pinned_empty(count * self.slot_bytes)
        self._free = list(range(count))
        self._events: list = [None] * count  # the upload last queued from each slot
        self._lock = threading.Lock()
        self.count = count
        self.takes = 0
        self.misses = 0

    def fits(self, pixels: torch.Tensor | np.ndarray) -> bool:
        """Whether uint8 ``pixels`` fit a slot (the most crops an image has, or an image of at
        most as many bytes: ~1.86 million pixels for Moondream's 13 crops of 378 x 378)."""
        return pixels.dtype in (torch.uint8, np.uint8) and pixels.nbytes <= self.slot_bytes

    def stage(
        self,
        crops_hwc: torch.Tensor | np.ndarray,
        tiling: tuple[int, int],
        plan: CropPlan | None = None,
    ) -> CropPixels:
        """``crops_hwc`` (uint8 [N, crop, crop, 3], or with a ``plan`` the image [H, W, 3]: an
        array, read-only ones too) copied into a free slot; when no slot is free, in plain
        memory (a tensor as it is, an array copied)."""
        slot = self._take() if self.fits(crops_hwc) else None
        if slot is None:
            with self._lock:
                self.misses += 1
            if isinstance(crops_hwc, np.ndarray):
                crops_hwc = torch.from_numpy(crops_hwc.copy())
            return CropPixels(crops_hwc, tiling, plan=plan)
        start = slot * self.slot_bytes
        view = self._memory[start : start + crops_hwc.nbytes].view(tuple(crops_hwc.shape))
        # numpy's copy, on this thread alone: a torch copy this size runs on torch's OpenMP
        # threads, which then spin-wait on every core the crop workers need (a 1280 x 960
        # image's two parts took 4.5 ms each, not 3.1, beside them)
        np.copyto(
            view.numpy(), crops_hwc if isinstance(crops_hwc, np.ndarray) else crops_hwc.numpy()
        )
        crops = CropPixels(view, tiling, (self, slot), plan)
        weakref.finalize(crops, self._give_back, slot)
        return crops

    def uploaded(self, slot: int) -> None:
        """An upload from ``slot`` is queued on the current stream: the slot is not reused
        before it has run."""
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event

    def _take(self) -> int | None:
        with self._lock:
            for i, slot in enumerate(self._free):
                event = self._events[slot]
                if event is None or event.query():
                    self._events[slot] = None
                    self.takes += 1
                    return self._free.pop(i)
        return None

    def _give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

"""The image wing: from a decoded image to its vision encoder's input, and nothing more.

The runtime asks the wing for one thing, an image's encoder input: ``CropPool.pixels(image)``
(``pool.py``) gives its ``CropPixels``, whose ``encoder_input(dtype, device)`` is the normalized
crops the vision encoder takes and whose ``tiling`` is their (rows, cols). How the crops are
planned, made (host or device) and staged stays here; the engine also starts the pool's worker
processes (``pool.start_workers``) and holds an image's crops from submission on (``hold``).

- planning and the host crops: ``overlap.py``, the tiling (``select_tiling``), the geometry of
  an image's crops (``crop_geometry``: the size of the copy the local crops are cut from, and
  where), its parts, and the crops themselves through libvips (numpy and pyvips only: the
  worker processes import it without torch);
- the resamplers: ``resample.py``, libvips' resize as tables of integer weights (numpy only);
  ``device.py``, the same bytes made from those tables with tensors on the encoder's device,
  by the Triton resample kernel where it runs (``kestrel_kernels/triton_resample.py``), whose
  per-image-size layout is ``stages.py``;
- making them off the scheduler thread: ``pool.py`` (``CropPool``: holds and prefetches; what
  the runtime and the engine use), ``maker.py`` (one image's crops, in parts, by worker
  processes, on part threads, or on the device), ``procs.py`` (the worker processes),
  ``worker.py`` (what each runs), ``arenas.py`` (the shared memory they write into, reused),
  ``staging.py`` (the pinned memory the crops or the image are staged in for a GPU).

Layers: the runtime and the engine import the wing; the wing imports the model
(``kestrel.moondream``: ``VisionConfig``, and ``vision.normalize_pixels`` / ``pixel_table``,
the reference's normalization, which stays the model's), the kernels and ``kestrel.images``
(``PreparedImage``); the model never imports the wing. The crop geometry belongs here, not in
the model: the model's vision tower takes normalized crops and their tiling, a plain
(rows, cols) pair, and reassembles the local crops' features from the tiling and its own
config (``grid_side``, ``overlap_margin``); it needs no crop size, margin in pixels or resized
copy. Everything that needs those (the host crops, the device's tables, the engine's decode
that stops at the resized copy's size) is the wing's or above it.

This package's face is ``overlap.py``'s planning alone (no pool, no model, no torch of its
own); the pool is ``kestrel.crops.pool``.
"""

from __future__ import annotations

from kestrel.crops.overlap import (
    CropError,
    CropGeometry,
    OverlapCrops,
    crop_geometry,
    overlap_crops,
    select_tiling,
)

__all__ = [
    "CropError",
    "CropGeometry",
    "OverlapCrops",
    "crop_geometry",
    "overlap_crops",
    "select_tiling",
]

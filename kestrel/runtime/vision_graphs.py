"""The vision encoder replayed from one CUDA graph per crop count (1 .. 1 + max_crops).

The encoder runs every crop through the same layers, so its shape depends only on how many
crops an image has; each count's encoder is captured once, at start-up, reading a fixed
pixel buffer and writing fixed features. What depends on the tiling (stitching the local tiles,
pooling them to the patch grid, the projection) runs after the replay, eagerly: a few kernels.
An image with more crops than any bucket, or a capture that failed at start-up, runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

import kestrel.runtime.cuda_graphs as cuda_graphs
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.vision import (
    check_crops,
    pooled_local_features,
    vision_encoder,
    vision_projection,
)
from kestrel_kernels.counting import graph_body

__all__ = ["VisionGraphs"]

log = logging.getLogger("kestrel.runtime")


@dataclass(slots=True)
class _Bucket:
    pixels_NCHW: Tensor
    graph: object | None = None
    features: Tensor | None = None


class VisionGraphs:
    """``encode(pixels, tiling)`` = ``encode_image``, its encoder from the crop count's graph."""

    def __init__(self, model: MoondreamModel, *, capture: bool = True) -> None:
        self.model, self.capture = model, capture
        cfg, w = model.config.vision, model.vision
        self._buckets = {
            n: _Bucket(torch.zeros(n, cfg.in_channels, cfg.crop_size, cfg.crop_size,
                                   dtype=w.pos_emb.dtype, device=w.pos_emb.device))
            for n in range(1, 2 + cfg.max_crops)
        }  # fmt: skip
        self._capturer: cuda_graphs.GraphCapture | None = None
        self.failures: dict[int, str] = {}
        self.replays = 0

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(n for n, b in self._buckets.items() if b.graph is not None)

    def capture_all(self) -> None:
        """Capture every crop count (start-up only; a failure is logged, that count eager)."""
        if not self.capture:
            return
        for n, bucket in self._buckets.items():
            if bucket.graph is not None or n in self.failures:
                continue
            if self._capturer is None:
                self._capturer = cuda_graphs.GraphCapture(bucket.pixels_NCHW.device)
            try:
                bucket.graph, (bucket.features,) = self._capturer.capture(
                    lambda b=bucket: (self._encoder(b.pixels_NCHW),)
                )
            except RuntimeError as exc:
                self.failures[n] = str(exc)
                log.warning("vision graph capture failed for %d crops (%s); eager", n, exc)

    def input_buffer(self, n_crops: int, dtype: torch.dtype) -> Tensor | None:
        """The encoder's own input for ``n_crops`` crops, where crops made on the device may be
        written (``encode`` then copies nothing): the graph's buffer; None for a count without
        one or another dtype."""
        bucket = self._buckets.get(n_crops)
        if bucket is None or bucket.pixels_NCHW.dtype != dtype:
            return None
        return bucket.pixels_NCHW

    def encode(self, pixels_NCHW: Tensor, tiling: tuple[int, int]) -> Tensor:
        """Normalized crops + tiling -> image embeddings [n_patches, proj_out_dim]."""
        cfg, w = self.model.config.vision, self.model.vision
        check_crops(pixels_NCHW, tiling, cfg)
        bucket = self._buckets.get(pixels_NCHW.shape[0])
        if bucket is None or bucket.graph is None:
            same = pixels_NCHW.device == w.pos_emb.device and pixels_NCHW.dtype == w.pos_emb.dtype
            x = pixels_NCHW if same else pixels_NCHW.to(w.pos_emb.device, w.pos_emb.dtype)
            with graph_body():  # what a replay would launch, for a launch counter
                features = self._encoder(x)
        else:
            if pixels_NCHW is not bucket.pixels_NCHW:  # not already written there
                bucket.pixels_NCHW.copy_(pixels_NCHW)
            bucket.graph.replay()
            self.replays += 1
            features = bucket.features
        local = pooled_local_features(features[1:], tiling, cfg)
        return vision_projection(torch.cat([features[0], local], dim=-1), w)

    def _encoder(self, pixels_NCHW: Tensor) -> Tensor:
        return vision_encoder(pixels_NCHW, self.model.vision, self.model.config.vision)

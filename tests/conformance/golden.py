"""Reading a golden fixture directory (format: the fixture's README) and comparing against it.

Generic over fixtures: everything (cases, images, tolerances) comes from golden.json, nothing
from a particular fixture's ids. ``record`` keeps the largest error seen per (check, group) so
the session can print a table of observed errors against the tolerances.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.conftest import conformance_dirs
from tests.tolerance import assert_close as near
from tests.tolerance import bound

# (what, group, atol) -> (max abs error, atol, rtol, worst ratio |err| / (atol + rtol max|golden|))
OBSERVED: dict[tuple[str, str, float], tuple[float, float, float, float]] = {}


@dataclass(frozen=True)
class Golden:
    dir: Path
    meta: dict
    tensors: dict[str, torch.Tensor] = field(repr=False)

    def tol(self, group: str, case: dict | None = None) -> tuple[float, float]:
        t = (case or {}).get("tolerance", {}).get(group) or self.meta["tolerances"][group]
        return float(t["atol"]), float(t["rtol"])

    def image(self, name: str) -> dict:
        return next(im for im in self.meta["images"] if im["name"] == name)

    def crops_u8(self, name: str) -> np.ndarray:
        """The reference's uint8 crops [N, crop, crop, 3] read from the PNGs."""
        paths = self.image(name)["crops"]
        return np.stack([np.asarray(Image.open(self.dir / p).convert("RGB")) for p in paths])

    def pixels(self, name: str) -> torch.Tensor:
        """The reference crops mapped through pixel_lut: [N, 3, crop, crop] float32."""
        lut = self.tensors[self.meta["pixel_lut"]["tensor"]]
        crops = torch.from_numpy(self.crops_u8(name)).long()
        return lut[crops].permute(0, 3, 1, 2).contiguous()


@functools.lru_cache(maxsize=4)
def load_golden(directory: Path) -> Golden:
    meta = json.loads((directory / "golden.json").read_text())
    tensors = load_file(str(directory / meta["files"]["tensors"]))
    return Golden(directory, meta, tensors)


def fixture_params(per_fixture=None) -> list:
    """pytest params over the conformance fixtures: ``fx`` alone, or (``fx``, item) for every
    item ``per_fixture(meta)`` lists; ids ``<fixture>`` / ``<fixture>-<item id>``."""
    out = []
    for d in conformance_dirs():
        if per_fixture is None:
            out.append(pytest.param(d, id=d.name))
            continue
        for item_id, item in per_fixture(load_golden(d).meta):
            out.append(pytest.param(d, item, id=f"{d.name}-{item_id}"))
    return out


def assert_close(
    actual: torch.Tensor, golden: torch.Tensor, atol: float, rtol: float, what: str, group: str
) -> None:
    """|actual - golden| <= atol + rtol max|golden| for every element (tests/tolerance.py: the
    fixture's ``atol`` is the floor, its ``rtol`` scales with the golden tensor's largest
    magnitude); records the observed error, and the message names the worst element."""
    actual = actual.detach().float().cpu()
    golden = golden.float()
    assert actual.shape == golden.shape, (
        f"{what}: shape {list(actual.shape)} != {list(golden.shape)}"
    )
    err = (actual - golden).abs()
    allowed = bound(golden, rel=rtol, floor=atol)
    ratio = float(err.max()) / allowed if err.numel() else 0.0
    key = (what, group, atol)  # one row per check and case
    prev = OBSERVED.get(key)
    if prev is None or float(err.max()) > prev[0]:
        OBSERVED[key] = (float(err.max()), atol, rtol, max(ratio, prev[3] if prev else 0.0))
    near(actual, golden, rel=rtol, floor=atol, msg=f"{what} ({group})")


def agreeing_prefix(mine: list[int], ref: list[int]) -> int:
    """Length of the common prefix of two decision sequences."""
    n = 0
    for a, b in zip(mine, ref, strict=False):
        if a != b:
            break
        n += 1
    return n

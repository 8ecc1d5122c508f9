from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.runtime import MoondreamRuntime
from kestrel.prefix_cache.tokens import TextToken
from tests.conftest import fixture_dir


@pytest.fixture(scope="session")
def model() -> MoondreamModel:
    return MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def images() -> dict[str, np.ndarray]:
    d = fixture_dir() / "images"
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in sorted(d.glob("*.png"))}


@pytest.fixture
def make_runtime(model):
    made = []

    def make(**kw) -> MoondreamRuntime:
        kw.setdefault("kv_cache_pages", 6000)
        kw.setdefault("max_batch_size", 8)
        rt = MoondreamRuntime(model, **kw)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.check_integrity()


def text_tokens(ids) -> list[TextToken]:
    return [TextToken(int(i)) for i in ids]

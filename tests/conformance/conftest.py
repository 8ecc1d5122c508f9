"""Session fixtures for the golden conformance suite: the model, tokenizer and eager runner are
loaded once per dtype; encoded images and case runs are cached so each is computed once."""

from __future__ import annotations

import pytest
import torch

from kestrel.moondream.lora import LoraAdapter, load_adapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.reference.eager import EagerMoondream
from tests.conformance.golden import OBSERVED, Golden, load_golden


class Runner:
    """An EagerMoondream in one dtype plus memoized image encodings (crops from the PNGs)."""

    def __init__(self, golden: Golden, dtype: torch.dtype) -> None:
        self.golden = golden
        model = MoondreamModel.from_pretrained(golden.dir, dtype=dtype)
        self.eager = EagerMoondream(model, MoondreamTokenizer.from_dir(golden.dir))
        self.model = model
        self._vision: dict[str, object] = {}
        self._encoded: dict[tuple[str, str | None], object] = {}
        self.runs: dict[str, object] = {}
        self._adapter: LoraAdapter | None = None

    def adapter(self) -> LoraAdapter:
        if self._adapter is None:
            self._adapter = load_adapter(
                self.golden.dir / self.golden.meta["files"]["adapter"],
                self.model.config,
                name=self.golden.meta["adapter"]["variant_id"],
                dtype=self.model.dtype,
            )
        return self._adapter

    def vision(self, name: str):
        from kestrel.moondream.vision import encode_image_with_intermediates

        if name not in self._vision:
            px = self.golden.pixels(name).to(self.model.dtype)
            tiling = tuple(self.golden.image(name)["tiling"])
            with torch.inference_mode():
                self._vision[name] = encode_image_with_intermediates(
                    px, tiling, self.model.vision, self.model.config.vision
                )
        return self._vision[name]

    def encoded(self, name: str, adapter: LoraAdapter | None = None):
        key = (name, None if adapter is None else adapter.lora_id)
        if key not in self._encoded:
            tiling = tuple(self.golden.image(name)["tiling"])
            self._encoded[key] = self.eager.encode_embeddings(
                self.vision(name).img_emb, tiling, adapter=adapter
            )
        return self._encoded[key]


@pytest.fixture(scope="session")
def golden(fx) -> Golden:
    """``fx``: the fixture directory, parametrized by each test (session scope)."""
    return load_golden(fx)


@pytest.fixture(scope="session")
def fp32(golden: Golden) -> Runner:
    return Runner(golden, torch.float32)


@pytest.fixture(scope="session")
def bf16(golden: Golden) -> Runner:
    return Runner(golden, torch.bfloat16)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Print the largest error observed per golden check next to its tolerance."""
    if not OBSERVED:
        return
    tr = terminalreporter
    tr.section("golden conformance: max |error| observed vs tolerance")
    tr.write_line(f"{'check':58} {'group':20} {'max err':>10} {'atol':>8} {'worst/bound':>11}")
    for (what, group, _), (err, atol, _rtol, ratio) in sorted(OBSERVED.items()):
        tr.write_line(f"{what:58} {group:20} {err:10.3g} {atol:8.3g} {ratio:11.3f}")

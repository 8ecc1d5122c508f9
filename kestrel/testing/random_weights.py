"""A Moondream model with random weights made directly on a device (no files, no host copy).

For GPU tests and benchmarks at real dimensions: the production config has 1.9 B parameters, which
take seconds to generate on a GPU but minutes to write, read and upload as a checkpoint. The
initialisation is ``random_checkpoint``'s (unit LayerNorm weights, small biases, weights scaled by
``1/sqrt(fan_in)``), drawn from a device generator.
"""

from __future__ import annotations

import math

import torch

from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.fp8 import quantize_rows
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.weights import expected_shapes

__all__ = ["random_model"]


def random_model(
    config: MoondreamConfig | None = None,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    fp8_experts: bool = False,
) -> MoondreamModel:
    """A ``MoondreamModel`` of ``config`` (default: production Moondream 2) on ``device``.

    ``fp8_experts``: Moondream 3's expert stacks in the published form (float8_e4m3 with a
    float32 scale per output row, ``fp8.quantize_rows``), each quantised as it is drawn, so
    the 16-bit stacks never exist together."""
    config = config or MoondreamConfig()
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    for name, shape in expected_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if (".ln" in name or "post_ln" in name) and leaf == "weight":
            sd[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        scale = 0.02 if leaf == "bias" else 1.0 / math.sqrt(shape[-1] if len(shape) > 1 else 1)
        if fp8_experts and len(shape) == 3 and name.endswith(("mlp.fc1.weight", "mlp.fc2.weight")):
            sd[name], sd[name.removesuffix("weight") + "scale"] = quantize_rows(t * scale)
            continue
        sd[name] = (t * scale).to(dtype)
    return MoondreamModel.from_state_dict(sd, config)

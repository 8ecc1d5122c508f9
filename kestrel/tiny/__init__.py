"""kestrel-tiny: the embedded model (``assets/model``), the synthetic scenes it is trained and
evaluated on, the dense training forward (``train_forward.py``: LoRA and full training, both
families), its eval, and ``kestrel demo`` (scenes in ``assets/demo``)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_DIR", "MODEL_DIR"]

MODEL_DIR = Path(__file__).parent / "assets" / "model"
DEMO_DIR = Path(__file__).parent / "assets" / "demo"

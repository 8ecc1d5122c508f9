"""The testing room: fixture makers (random-weight checkpoints, ``random_checkpoint.py``; random
weights on a device, ``random_weights.py``; the FP8 checkpoint writer, ``fp8_checkpoint.py``)
and the house rules: those read from the imports (``layers.py``), and those read from each
file's syntax and from a fresh ``import kestrel`` (``style_rules.py``).
Tests and scripts import it; nothing else in the packages may (``tests/unit/test_layers.py``)."""

from __future__ import annotations

"""The testing room: fixture makers (random-weight checkpoints, random weights, the FP8
checkpoint writer) and the house rules read from the imports (:mod:`kestrel.testing.layers`).
Tests and scripts import it; nothing else in the packages may (``tests/unit/test_layers.py``)."""

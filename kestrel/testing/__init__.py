"""The testing room: fixture makers (random-weight checkpoints, ``random_checkpoint.py``; random
weights on a device, ``random_weights.py``; the FP8 checkpoint writer, ``fp8_checkpoint.py``)
and the house rules read from the imports (``layers.py``).
Tests and scripts import it; nothing else in the packages may (``tests/unit/test_layers.py``)."""

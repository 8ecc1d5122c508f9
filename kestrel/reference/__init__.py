"""The project's own oracle: the uncached, one-request-at-a-time eager path driving the same
skills (``eager.py``, results in ``types.py``), the batched training forward, and random-weight
checkpoints for tests and benchmarks."""

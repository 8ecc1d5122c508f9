"""Everything that turns requests into forwards: the cached runtime (``MoondreamRuntime``:
prepare / prefill / commit / decode / release over the paged KV and the prefix cache; built
from ``RuntimeOptions`` in one place, ``build.py``), the sequences it runs, batched prefill,
the decode steps (``DecodeSteps``, the runtime's ``decoder``) and their CUDA graphs, KV-pool
sizing, the skills' model operations (``ModelHeads``) and the scheduler's executor
(``BatchExecutor``)."""

from __future__ import annotations

from kestrel.runtime.build import RuntimeOptions
from kestrel.runtime.runtime import MoondreamRuntime, RuntimeCounters
from kestrel.runtime.sequence import SequenceError, SequenceState

__all__ = [
    "MoondreamRuntime",
    "RuntimeCounters",
    "RuntimeOptions",
    "SequenceError",
    "SequenceState",
]

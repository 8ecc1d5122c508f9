"""Everything that turns requests into forwards: the cached runtime (``MoondreamRuntime``:
prepare / prefill / commit / decode / release over the paged KV and the prefix cache), the
sequences it runs, batched prefill, the decode step and its CUDA graphs, KV-pool sizing, the
skills' model operations (``ModelHeads``) and the scheduler's runner (``BatchExecutor``)."""

from __future__ import annotations

from kestrel.runtime.runtime import MoondreamRuntime, RuntimeCounters
from kestrel.runtime.sequence import SequenceError, SequenceState

__all__ = ["MoondreamRuntime", "RuntimeCounters", "SequenceError", "SequenceState"]

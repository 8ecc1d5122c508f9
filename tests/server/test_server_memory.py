"""The allocator settings of a long-running server (glibc Linux): bounded arenas, fixed
thresholds, an environment that wins, an opt-out, and the idle trim. Each case runs in a
subprocess, since ``mallopt`` changes the whole process. (The RSS it saves is measured by
``scripts/soak_server.py``, not here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kestrel.server import memory

pytestmark = pytest.mark.skipif(memory.glibc() is None, reason="needs glibc (Linux)")

# The trim runs in a thread named kestrel-trim that a successful poke starts: joining every
# such thread waits for the trims that were started (none when the pokes start none).
_PROBE = """
import json, threading
from kestrel.server.memory import IdleTrimmer, tune_allocator
applied = tune_allocator()
trimmer = IdleTrimmer(interval_s=60)
first, second = trimmer.poke(), trimmer.poke()
for thread in threading.enumerate():
    if thread.name == "kestrel-trim":
        thread.join(timeout=5)
print(json.dumps({"applied": applied, "pokes": [first, second], "trims": trimmer.trims}))
"""


def _probe(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "KESTREL_MAL"))}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env={**clean, **env}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_arenas_and_thresholds_are_set_and_idle_trims_once_per_interval() -> None:
    got = _probe()
    assert got["applied"] == {name: value for name, _, _, value in memory.ALLOCATOR_SETTINGS}
    assert got["applied"]["arena_max"] == 2
    assert got["pokes"] == [True, False] and got["trims"] == 1


def test_the_environment_wins_and_kestrel_malloc_system_opts_out() -> None:
    got = _probe(MALLOC_ARENA_MAX="4")
    assert "arena_max" not in got["applied"] and "mmap_threshold" in got["applied"]
    off = _probe(KESTREL_MALLOC="system")
    assert off == {"applied": {}, "pokes": [False, False], "trims": 0}

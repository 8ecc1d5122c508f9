"""Triton kernels built for an H100 (sm_90) on any machine, no GPU needed: in a fresh process,
since Triton's compiler cannot run where its interpreter is switched on (the suite's default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def sm90_builds(code: str, workdir: Path, timeout: int = 300) -> list[dict]:
    """Run ``code`` (Python that builds kernels in the folder ``sys.argv[1]`` and prints one
    JSON object a line) without ``TRITON_INTERPRET``: the objects it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", code, str(workdir)], env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()]


def assert_built(got: dict, max_registers: int) -> None:
    """A build that targets sm_90, has a cubin and spills no registers."""
    assert got["target"] and got["cubin_bytes"] > 0, got.get("report")
    assert got["spill_bytes"] == 0, got.get("report", got)
    assert 0 < got["registers"] <= max_registers, got.get("report", got)

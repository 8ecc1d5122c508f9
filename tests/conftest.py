from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fused_forms import interpreted  # noqa: F401  (a fixture: the fused ops' tests)

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_dir() -> Path:
    """The conformance fixture: ``KESTREL_FIXTURE_DIR`` or the bundled md2-tiny-a copy."""
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", FIXTURES / "md2-tiny-a"))


def conformance_dirs() -> list[Path]:
    """The fixtures the conformance suite runs on: ``KESTREL_FIXTURE_DIR`` alone if set, else
    every bundled one (Moondream 2 and Moondream 3)."""
    env = os.environ.get("KESTREL_FIXTURE_DIR")
    if env:
        return [Path(env)]
    return [FIXTURES / "md2-tiny-a", FIXTURES / "md3-tiny-a"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# torch's inductor keeps compiled kernels in one on-disk cache per user, and its keys miss two
# things the tests vary: ATEN_CPU_CAPABILITY (C++ built with AVX2 vectors is reused under
# ``default``, where it fails to build) and the checkout (another checkout's build of the kestrel
# ops, reused here, aborts the process). So the tests get a cache folder per checkout and
# capability, unless TORCHINDUCTOR_CACHE_DIR says otherwise.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import hashlib
    import tempfile

    _checkout = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:10]
    _capability = os.environ.get("ATEN_CPU_CAPABILITY", "native").lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{_checkout}_{_capability}"
    )

# The test command runs the suite on every core (pytest-xdist, ``-n auto``); each worker takes
# an equal share of the cores for torch's intra-op threads, so the workers never oversubscribe
# the machine (and a timing inside a test is not inflated by its neighbours' threads).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# Without a GPU the fused Triton kernels run under Triton's interpreter. The flag must be set
# before triton is first imported (its standard library, tl.sum and the like, is built then).
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The files that take longest (Ray clusters and replicas starting, inductor compiling, the soak):
# collected first, so that with ``-n auto --dist loadfile`` a worker starts on each of them at
# once and the others share the many short files, instead of one long file starting last and
# running alone at the end.
LONG_FIRST = (
    "tests/integration/test_ray_batch.py",
    "tests/integration/test_compile_path.py",
    "tests/server/test_server_ray.py",
    "tests/integration/test_engine_soak.py",
)


def _long_first(item: pytest.Item) -> int:
    name = item.nodeid.split("::")[0]  # relative to the repository root
    return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_long_first)  # stable: every file keeps its tests' order
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""What a crop worker process imports (``kestrel/crops/worker.py``): the crops' own module
(``kestrel/crops/overlap.py``, numpy and pyvips) by an ordinary import, and nothing else of
kestrel, no torch. A fresh interpreter runs the worker's own boot up to its ``main``: the
``kestrel`` and ``kestrel.crops`` packages made bare (a plain ``import kestrel`` loads torch
and the engine), then ``from kestrel.crops import worker``."""

from __future__ import annotations

import json
import subprocess
import sys

from kestrel.crops import worker

REPORT = (
    "import json\n"
    "mods = sorted(sys.modules)\n"
    "print(json.dumps({'kestrel': [m for m in mods if m.split('.')[0] == 'kestrel'],\n"
    "                  'torch': [m for m in mods if m.split('.')[0] == 'torch'],\n"
    "                  'serves': worker.overlap.__name__, 'main': callable(worker.main)}))\n"
)


def _fresh(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, str(worker.ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_worker_imports_the_crops_and_no_torch() -> None:
    seen = _fresh(worker.IMPORT + REPORT)
    assert seen["torch"] == [], seen["torch"][:5]
    assert seen["kestrel"] == [
        "kestrel",
        "kestrel.crops",
        "kestrel.crops.overlap",
        "kestrel.crops.worker",
    ]
    assert seen["serves"] == "kestrel.crops.overlap" and seen["main"]


def test_the_boot_is_the_import_then_main() -> None:
    assert worker.BOOT.startswith(worker.IMPORT)
    assert worker.BOOT[len(worker.IMPORT) :] == "worker.main(sys.argv)\n"
    cmd = worker.command(7)
    assert cmd[:3] == [sys.executable, "-c", worker.BOOT] and cmd[3:] == [str(worker.ROOT), "7"]
    assert (worker.ROOT / "kestrel" / "crops" / "overlap.py").is_file()

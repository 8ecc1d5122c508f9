"""Ray stays optional: importing kestrel or building its CLI never imports Ray, and without Ray
``kestrel batch --ray`` and ``kestrel serve --ray`` say what to install (checked in a subprocess
where ``import ray`` fails, whether or not Ray is installed here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
imported = {}
import kestrel, kestrel.batch, kestrel.cli
kestrel.cli.build_parser()
imported["ray_after_import"] = "ray" in sys.modules
sys.modules["ray"] = None  # from here on, `import ray` fails as if it were not installed
try:
    import kestrel.distributed
except ImportError as exc:
    imported["distributed_error"] = str(exc)
code = kestrel.cli.main(["batch", "--ray", "--images", sys.argv[1], "--questions", sys.argv[2],
                         "--out", sys.argv[3], "--no-progress"])
imported["code"] = code
print(json.dumps(imported))
"""


def test_kestrel_without_ray(tmp_path) -> None:
    images = tmp_path / "imgs"
    images.mkdir()
    (images / "a.png").write_bytes(b"not read: the run stops before")
    questions = tmp_path / "q.txt"
    questions.write_text("What is this?\n")
    argv = [sys.executable, "-c", _PROBE, str(images), str(questions), str(tmp_path / "out")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ray_after_import"] is False
    assert 'pip install "kestrel[ray]"' in got["distributed_error"]
    assert got["code"] == 1  # as `kestrel serve` without its extra
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("kestrel: error: --ray needs Ray") and "kestrel[ray]" in err, err
    assert not (tmp_path / "out").exists()


_SERVE_PROBE = """
import sys
import kestrel.cli
sys.modules["ray"] = None  # `import ray` fails as if it were not installed
sys.exit(kestrel.cli.main(["serve", "--ray", "--port", "0"]))
"""


def test_kestrel_serve_ray_without_ray_says_what_to_install() -> None:
    pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')
    argv = [sys.executable, "-c", _SERVE_PROBE]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("kestrel: error: --ray needs Ray Serve") and "kestrel[ray]" in err, err

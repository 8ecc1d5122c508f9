"""``kestrel serve`` on the command line: the serve extra stays optional (importing kestrel or
its CLI loads no web stack; without it the command says what to install), and bad options fail
before the model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kestrel.cli import main

_PROBE = """
import sys
import kestrel, kestrel.cli, kestrel.server
kestrel.cli.build_parser()
heavy = sorted(m for m in sys.modules if m.split('.')[0] in
               ('starlette', 'uvicorn', 'prometheus_client', 'httpx', 'anyio'))
print(heavy)
"""


def test_importing_kestrel_loads_no_server_dependency() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_without_the_extra_names_it(monkeypatch, capsys) -> None:
    import kestrel.server

    monkeypatch.setattr(kestrel.server, "missing_dependencies", lambda: ["uvicorn"])
    assert main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kestrel: error:") and 'pip install "kestrel[serve]"' in err


def test_bad_options_fail_before_the_model_loads(capsys, tmp_path) -> None:
    pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--adapter", "no-equals-sign"])
    assert exited.value.code == 2
    missing = tmp_path / "missing.safetensors"
    assert main(["serve", "--adapter", f"fr={missing}", "--model", str(tmp_path)]) == 2
    assert "no such adapter" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        assert main(["serve", "--port", port, "--model", str(tmp_path)]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_a_bad_allow_origin_fails_before_the_model_loads(capsys, tmp_path) -> None:
    pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')
    for bad in ("app.example", "https://app.example/page"):
        assert main(["serve", "--allow-origin", bad, "--model", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--allow-origin" in err and "scheme://host" in err

"""The server of tests/server/test_server_ray.py: ``kestrel serve --ray --replicas 2`` in a
subprocess on a loopback port, and the HTTP helpers its tests share."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.conftest import ADAPTER, ADAPTER_DIR, ENGINE_OPTIONS, MODEL

KEY = "ray-front-door-key"
AUTH = {"X-Moondream-Auth": KEY}
NAMES = ["kestrel-replica-0", "kestrel-replica-1"]
STARTUP_S = 240  # bounds on waiting, never asserted
WAIT_S = 120


@dataclass(frozen=True, slots=True)
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT/v1
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.split("//")[1].split("/")[0].split(":")
        return host, int(port)


@contextlib.contextmanager
def running_server(log: Path, *flags: str) -> Iterator[Server]:
    """``kestrel serve --ray --replicas 2`` with ``flags``, up until the block ends (then
    SIGTERM, which also stops its Ray instance, unless a test stopped it already)."""
    options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
    with _launch(log, "--replicas", "2", "--model", str(MODEL), *options,
                 "--adapter", f"{ADAPTER}={ADAPTER_DIR}", *flags) as server:  # fmt: skip
        yield server


def attached_door(log: Path, ray_address: str) -> contextlib.AbstractContextManager[Server]:
    """A second front door over the replicas of the server whose Ray is at ``ray_address``."""
    return _launch(log, "--ray-attach", "--ray-address", ray_address)


@contextlib.contextmanager
def _launch(log: Path, *flags: str) -> Iterator[Server]:
    cmd = [sys.executable, "-m", "kestrel", "serve", "--ray", "--port", "0", "--api-key", KEY,
           "--log-level", "warning", *flags]  # fmt: skip
    # A local Ray instance of its own, never a cluster of the caller's ($RAY_ADDRESS); token
    # authentication on, so that a second front door joins it with the same token.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + STARTUP_S
    found = None
    while found is None and time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:\d+/v1", log.read_text(errors="replace"))
        time.sleep(0.2)
    if found is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"kestrel serve --ray did not start:\n{log.read_text(errors='replace')}")
    try:
        yield Server(proc, found.group(0), log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def request(server: Server, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    """``path`` under /v1 (the API key sent unless ``headers`` are given): status, headers,
    the JSON body."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    req = urllib.request.Request(server.url + path, data=data, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def post(server: Server, route: str, body) -> tuple[int, dict]:
    status, _, got = request(server, f"/{route}", body)
    return status, got


def stats(server: Server) -> dict:
    status, _, got = request(server, "/stats")
    assert status == 200, got
    return got


def idle_stats(server: Server) -> dict:
    """/v1/stats once nothing is queued or running anywhere (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        s = stats(server)
        if (s["running"], s["queue_depth"], s["server"]["in_flight"]) == (0, 0, 0):
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def assert_pages_conserved(s: dict) -> None:
    """No page locked or private on any replica; every page free or cached; sums agree."""
    assert [r["live"] for r in s["replicas"]] == [True, True], s["replicas"]
    for r in (s, *s["replicas"]):
        assert r["pages_locked"] == 0 and r["pages_private"] == 0, r
        assert r["pages_free"] + r["pages_cached"] == r["pages_total"], r
    assert s["pages_total"] == sum(r["pages_total"] for r in s["replicas"])


def events(text: str) -> list[dict]:
    lines = [ln for ln in text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [json.loads(ln[6:]) for ln in lines if ln != "data: [DONE]"]


def stream(server: Server, route: str, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection(*server.address, timeout=WAIT_S)
    conn.request("POST", f"/v1/{route}", json.dumps(body),
                 {"Content-Type": "application/json", **AUTH})  # fmt: skip
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/event-stream")
    got = events(response.read().decode())
    conn.close()
    return got


def stable(value):
    """A JSON body less what differs between two servers by nature (ids, start times)."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in ("request_id", "created")}
    return [stable(v) for v in value] if isinstance(value, list) else value


def raw(server: Server, method: str, path: str, body) -> tuple[int, str, bytes]:
    data = None if body is None else json.dumps(body).encode()
    url = server.url.removesuffix("/v1") + path
    headers = AUTH if body is None else {**AUTH, "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, r.headers["content-type"], r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["content-type"], err.read()

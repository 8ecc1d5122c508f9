"""The playground page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``.ci/run``) driven by selenium against ``kestrel serve`` on
the bundled kestrel-tiny, with an API key and the French-colours adapter.

The test uploads a demo scene, chats (streamed), runs detect and checks the drawn boxes against
the API's own answer, asks again and reads the cached share, sends a second image, and checks
that the page's calls are refused until the key is entered. It saves a screenshot (set
``KESTREL_PLAYGROUND_SCREENSHOT=docs/playground.png`` to refresh the README's). No browser
means a failure with the install line, not a skip; ``KESTREL_SKIP_BROWSER=1`` skips on purpose.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

import kestrel.tiny

if os.environ.get("KESTREL_SKIP_BROWSER") == "1":
    pytest.skip("KESTREL_SKIP_BROWSER=1: the browser test is skipped", allow_module_level=True)
pytest.importorskip("uvicorn", reason='needs the serve extra: pip install "kestrel[serve]"')

CHROMIUM = os.environ.get("KESTREL_CHROMIUM", "/usr/bin/chromium")
DRIVER = os.environ.get("KESTREL_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver (or KESTREL_SKIP_BROWSER=1 to skip)"
TINY = Path(kestrel.tiny.__file__).parent / "assets"
SCENES = TINY / "demo"
KEY = "playground-test-key"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1280,800", "--force-device-scale-factor=1",
]  # fmt: skip
WAIT_S = 120  # bounds on waiting, never asserted
PIXELS = 3  # how far a drawn box may sit from the API's coordinates, in screen pixels


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"the browser test needs {missing}: {INSTALL}")
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.fail('the browser test needs selenium: pip install -e ".[test]"')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("playground") / "server.log"
    cmd = [
        sys.executable, "-m", "kestrel", "serve", "--device", "cpu", "--dtype", "float32",
        "--port", "0", "--api-key", KEY, "--adapter", f"fr={TINY / 'model' / 'lora-french'}",
        "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + WAIT_S
    found = None
    while found is None and time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"http://127\.0\.0\.1:\d+", log.read_text(errors="replace"))
        time.sleep(0.1)
    if found is None:
        proc.kill()
        pytest.fail(f"kestrel serve did not start:\n{log.read_text(errors='replace')}")
    yield found.group(0)
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="kestrel-chromium-")
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, check, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(
        lambda d: check(d), message=f"waiting for {what}"
    )


def _open(driver, url: str) -> None:
    driver.get(url + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(url + "/")
    _wait(driver, lambda d: d.execute_script("return document.body.dataset.ready"), "the page")


def _by_id(driver, name: str):
    return driver.find_element("id", name)


def _upload(driver, scene: str) -> None:
    before = len(driver.find_elements("css selector", ".thumb"))
    _by_id(driver, "file").send_keys(str(SCENES / scene))
    _wait(driver, lambda d: len(d.find_elements("css selector", ".thumb")) > before, "the image")
    loaded = "const p = document.getElementById('picture'); return p.complete && p.naturalWidth > 0"
    _wait(driver, lambda d: d.execute_script(loaded), "the picture to load")


def _ask(driver, mode: str, text: str) -> dict:
    """Send one turn; return its answer, error and meta figures once it has ended."""
    from selenium.webdriver.common.keys import Keys

    _by_id(driver, "log")  # the page is there
    driver.find_element("css selector", f'input[name="mode"][value="{mode}"]').click()
    turns = len(driver.find_elements("css selector", ".turn"))
    prompt = _by_id(driver, "prompt")
    prompt.clear()
    prompt.send_keys(text, Keys.ENTER)  # Enter sends
    ended = ".turn.done, .turn.failed"
    _wait(driver, lambda d: len(d.find_elements("css selector", ended)) > turns, "an answer")
    turn = driver.find_elements("css selector", ".turn")[-1]
    error = turn.find_elements("css selector", ".error")
    meta = turn.find_element("css selector", ".meta")
    return {
        "answer": turn.find_element("css selector", ".answer").text,
        "error": error[0].text if error else None,
        "meta": meta.text,
        "cached": int(meta.get_attribute("data-cached") or -1),
        "prompt": int(meta.get_attribute("data-prompt") or -1),
    }


def _api(url: str, route: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}/v1/{route}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        return json.loads(r.read())


def _enter_key(driver, key: str) -> str:
    from selenium.webdriver.common.keys import Keys

    field = _by_id(driver, "api-key")
    field.clear()
    field.send_keys(key, Keys.ENTER)
    state = _by_id(driver, "key-state")
    _wait(driver, lambda d: state.text in ("key accepted", "key refused"), "the key check")
    return state.text


def test_calls_are_refused_until_the_key_is_entered(server, browser) -> None:
    _open(browser, server)
    state = _by_id(browser, "key-state")
    _wait(browser, lambda d: state.text == "this server needs a key", "the key probe")
    _upload(browser, "scene_0.png")
    refused = _ask(browser, "chat", "What color is the circle?")
    assert refused["error"] is not None and refused["error"].startswith("401 unauthorized")
    assert _enter_key(browser, "wrong") == "key refused"
    assert _ask(browser, "caption", "")["error"].startswith("401 unauthorized")
    assert _enter_key(browser, KEY) == "key accepted"
    answered = _ask(browser, "chat", "What color is the circle?")
    assert answered["error"] is None and answered["answer"].strip(), answered


def _data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _drawn_boxes(driver) -> tuple[dict, list[dict]]:
    """The picture's and the drawn boxes' rectangles on screen, in CSS pixels."""
    return driver.execute_script("""
        const r = (e) => { const b = e.getBoundingClientRect();
                           return {x: b.left, y: b.top, w: b.width, h: b.height}; };
        return [r(document.getElementById('picture')),
                [...document.querySelectorAll('#overlay rect.box')].map(r)];
    """)


def _check_boxes(driver, objects: list[dict]) -> None:
    picture, boxes = _drawn_boxes(driver)
    assert len(boxes) == len(objects) >= 1, (boxes, objects)
    for box, obj in zip(boxes, objects, strict=True):
        want = {
            "x": picture["x"] + obj["x_min"] * picture["w"],
            "y": picture["y"] + obj["y_min"] * picture["h"],
            "w": (obj["x_max"] - obj["x_min"]) * picture["w"],
            "h": (obj["y_max"] - obj["y_min"]) * picture["h"],
        }
        assert all(abs(box[k] - want[k]) <= PIXELS for k in want), (box, want)


def test_chat_detect_cache_and_a_second_image(server, browser, tmp_path) -> None:
    _open(browser, server)
    assert _enter_key(browser, KEY) == "key accepted"
    adapters = browser.find_elements("css selector", "#adapter option")
    assert [a.get_attribute("value") for a in adapters] == ["", "fr"]  # the adapter list
    _upload(browser, "scene_0.png")

    first = _ask(browser, "chat", "What color is the circle?")
    assert first["error"] is None and first["answer"].strip(), first
    assert first["prompt"] > 0 and re.match(r"TTFT \d+ ms · cached \d+ of", first["meta"])

    detect = _ask(browser, "detect", "yellow circle")
    assert detect["error"] is None, detect
    body = {"image_url": _data_url(SCENES / "scene_0.png"), "object": "yellow circle"}
    _check_boxes(browser, _api(server, "detect", body)["objects"])
    assert detect["cached"] > 0  # the image's block, from the chat turn

    # A new conversation about the same image: its block comes from the cache.
    _by_id(browser, "reset").click()
    second = _ask(browser, "chat", "How many shapes are there?")
    assert second["error"] is None and second["answer"].strip(), second
    assert 0 < second["cached"] < second["prompt"], second
    assert "%)" in second["meta"] and not second["meta"].endswith("(0%)")

    browser.save_screenshot(str(tmp_path / "playground.png"))
    if os.environ.get("KESTREL_PLAYGROUND_SCREENSHOT"):
        shutil.copy(tmp_path / "playground.png", os.environ["KESTREL_PLAYGROUND_SCREENSHOT"])

    # The conversation's next turn is a hit through the whole of the last turn's prompt.
    third = _ask(browser, "chat", "What shape is red?")
    assert third["error"] is None, third  # kestrel-tiny may answer a later turn with nothing
    assert third["cached"] >= second["prompt"], (second, third)

    # A second image in the conversation: answered, or refused with the server's reason (while
    # one image per conversation is the limit); either way the conversation goes on.
    _upload(browser, "scene_1.png")
    more = _ask(browser, "chat", "What color is the square?")
    if more["error"] is not None:
        assert more["error"].startswith("400 invalid_request") and "image" in more["error"]
    _by_id(browser, "reset").click()
    after = _ask(browser, "chat", "What color is the square?")
    assert after["error"] is None and after["answer"].strip(), after

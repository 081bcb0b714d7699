"""A real headless browser for page tests: Debian's `chromium`, driven over the DevTools
protocol (a websocket, `websockets`' sync client), so nothing is downloaded at run time.

`Browser.evaluate` runs JavaScript in the page and returns its JSON value; `screenshot`
writes a PNG. Without `chromium` a test fails, naming the install command (as Redis's do).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

START_TIMEOUT_S = 30.0


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("no chromium: apt-get install chromium (Debian's; .ci/run installs it)")
    return exe


class Browser:
    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events that arrive meanwhile are dropped."""
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=60))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0,
                 explain: Callable[[], Any] | None = None) -> Any:
        """The expression's value once truthy, polled; a failure says what the page showed."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                shown = explain() if explain else self.evaluate("document.body.innerText")
                raise AssertionError(f"not within {timeout_s:.0f}s: {expression}\n{shown}")
            time.sleep(0.25)
        return value

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))


@contextmanager
def browser(width: int = 1400, height: int = 1000) -> Iterator[Browser]:
    exe = chromium()
    profile = Path(tempfile.mkdtemp(prefix="orchard-chromium-"))
    proc = subprocess.Popen(
        [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}", f"--window-size={width},{height}",
         "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
                 if t["type"] == "page"]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as socket:
            page = Browser(socket)
            page.call("Page.enable")
            page.call("Runtime.enable")
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)

"""A small Chrome DevTools Protocol client: headless Chromium with one page, JSON-RPC over the page's websocket.

Used by the live page's browser tests (tests/e2e/test_page.py) and by docs/screenshot.py. Needs only the
``websockets`` package (which uvicorn[standard] brings) and a ``chromium`` on PATH.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

__all__ = ["INSTALL_HINT", "Browser", "CdpError", "ChromiumMissing", "find_chromium"]

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = "the live page's browser tests need headless Chromium: `make test` installs it (as root), or run `apt-get install chromium`"


class ChromiumMissing(RuntimeError):
    """No Chromium on PATH."""


class CdpError(RuntimeError):
    """A DevTools call failed, or the page's script threw."""


def find_chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    raise ChromiumMissing(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}); {INSTALL_HINT}")


class Browser:
    """``with Browser() as browser:`` a headless Chromium, stopped (and its profile removed) on exit."""

    def __init__(self, executable: str | None = None, *, width: int = 1280, height: int = 900, timeout: float = 30.0):
        self.executable = executable or find_chromium()
        self.width = width
        self.height = height
        self.timeout = timeout
        self._stack = ExitStack()
        self._ids = 0

    def __enter__(self) -> Browser:
        try:
            profile = Path(
                self._stack.enter_context(tempfile.TemporaryDirectory(prefix="chromium-", ignore_cleanup_errors=True))
            )
            self._log = profile / "chromium.log"
            with self._log.open("wb") as log:
                self._proc = subprocess.Popen(
                    [
                        self.executable,
                        "--headless=new",
                        "--no-sandbox",
                        "--disable-gpu",
                        "--disable-dev-shm-usage",
                        "--remote-debugging-port=0",
                        f"--user-data-dir={profile}",
                        f"--window-size={self.width},{self.height}",
                        "--no-first-run",
                        "--no-default-browser-check",
                        "--disable-extensions",
                        "--disable-background-networking",
                        "--hide-scrollbars",
                        "--mute-audio",
                        "about:blank",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self._stack.callback(self._stop)
            port = self._devtools_port(profile)
            self._ws: ClientConnection = self._stack.enter_context(
                connect(self._page_socket(port), max_size=None, proxy=None, open_timeout=self.timeout)
            )
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=self.height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()

    def _stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _failed(self, what: str) -> CdpError:
        tail = self._log.read_text(errors="replace")[-2000:] if self._log.exists() else ""
        return CdpError(f"{what}; Chromium's output ends with:\n{tail}")

    def _devtools_port(self, profile: Path) -> int:
        # Chromium writes the port it bound (with --remote-debugging-port=0) into the profile folder.
        marker = profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise self._failed(f"Chromium exited with status {self._proc.returncode} before it listened")
            lines = marker.read_text().split() if marker.exists() else []
            if lines and lines[0].isdigit():
                return int(lines[0])
            time.sleep(0.05)
        raise self._failed(f"Chromium wrote no DevToolsActivePort within {self.timeout:g}s")

    def _page_socket(self, port: int) -> str:
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", trust_env=False, timeout=self.timeout).json()
        for target in targets:
            if target.get("type") == "page":
                url: str = target["webSocketDebuggerUrl"]
                return url
        raise self._failed(f"Chromium has no page target: {targets!r}")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result. Events (none are enabled) are skipped."""
        self._ids += 1
        call_id = self._ids
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{method}: no answer from Chromium within {self.timeout:g}s")
            message = json.loads(self._ws.recv(timeout=left))
            if message.get("id") != call_id:
                continue
            if "error" in message:
                raise CdpError(f"{method}: {message['error']}")
            result: dict[str, Any] = message.get("result", {})
            return result

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(f"{expression[:200]!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 15.0) -> Any:
        """Evaluate ``expression`` until it is truthy; its value. A TimeoutError naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while True:
            try:
                value = self.evaluate(expression)
            except CdpError as exc:  # e.g. the page is between two documents
                value = exc
            else:
                if value:
                    return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout:g}s: {what} (last value: {value!r})")
            time.sleep(0.05)

    def navigate(self, url: str) -> None:
        """Open ``url`` and wait for its document to load (a fragment-only change loads nothing)."""
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise CdpError(f"navigating to {url}: {result['errorText']}")
        self.wait_for(
            f"location.href === {json.dumps(url)} && document.readyState === 'complete'", f"{url} loaded", self.timeout
        )

    def screenshot(self, path: Path, width: int = 1280) -> None:
        """A PNG of the whole page at ``width`` CSS pixels, as tall as the page."""
        settle = "new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))"
        height = self.height
        for _ in range(3):  # a new width can change the page's height, which can change its width (a scrollbar)
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
            self.evaluate(settle)
            needed = int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)"))
            if needed == height:
                break
            height = needed
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        path.write_bytes(base64.b64decode(shot["data"]))

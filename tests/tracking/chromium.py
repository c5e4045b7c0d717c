"""Headless Chromium driven over the Chrome DevTools protocol (aiohttp's websocket client, which
MLflow already needs): open an address, wait until a script in the page says it is ready, read the
page, take a screenshot. Debian's `chromium`; `.ci/run` installs it for the slow tier."""
from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
from pathlib import Path

FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--remote-debugging-port=0")


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab of a headless Chromium started with a fresh profile in `profile_dir`."""

    def __init__(self, profile_dir: Path, *, width: int = 1600, height: int = 1200):
        self.profile_dir, self.size = Path(profile_dir), (width, height)
        self.proc: subprocess.Popen | None = None
        self._ws = self._session = None
        self._id = 0

    async def __aenter__(self) -> "Page":
        import aiohttp

        exe = executable()
        assert exe, "no chromium"
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile_dir}",
                                      f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        browser_ws = await asyncio.to_thread(self._devtools_address)
        port = browser_ws.split("//", 1)[1].split("/", 1)[0]
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://{port}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        return self

    def _devtools_address(self) -> str:
        for line in self.proc.stderr:   # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
            if line.startswith("DevTools listening on "):
                return line.split()[-1]
        raise AssertionError(f"chromium exited ({self.proc.wait()}) before its DevTools address")

    async def __aexit__(self, *exc) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    async def send(self, method: str, **params) -> dict:
        """One protocol command; its result (events that come before it are skipped)."""
        self._id += 1
        await self._ws.send_str(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads((await self._ws.receive()).data)
            if msg.get("id") == self._id:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    async def open(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str):
        """The value of a JavaScript expression in the page."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, timeout_s: float = 120, every_s: float = 0.5):
        """Poll `expression` until it is truthy; its value. On timeout, the last value and the page's text."""
        deadline, value = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(every_s)
        text = await self.eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
        raise AssertionError(f"timed out waiting for {expression!r} (last {value!r}); page text:\n{text}")

    async def screenshot(self, path: Path) -> Path:
        data = (await self.send("Page.captureScreenshot", format="png"))["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)

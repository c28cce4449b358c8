"""Headless Debian chromium driven over the DevTools protocol, for end-to-end tests.

``async with chromium() as page`` starts ``/usr/bin/chromium --headless`` with a throwaway
profile and every network feature that could phone home switched off, attaches to its first
tab over the DevTools websocket and yields a ``Page``: ``goto``, ``evaluate``, ``wait_for``
(poll a JS expression until truthy), ``click``, ``screenshot``. Uncaught page exceptions and
console errors are collected in ``page.errors`` so a test can assert the page ran clean.
No browser is downloaded: ``CHROMIUM`` is None when Debian's package is not installed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import websockets

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--no-proxy-server",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


class CDPError(RuntimeError):
    pass


class Page:
    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self.errors: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self._ws:
            message = json.loads(raw)
            if "id" in message:
                future = self._pending.pop(message["id"], None)
                if future is not None and not future.done():
                    if "error" in message:
                        future.set_exception(CDPError(str(message["error"])))
                    else:
                        future.set_result(message.get("result", {}))
            elif message.get("method") == "Runtime.exceptionThrown":
                details = message["params"]["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                self.errors.append(f"exception: {text}")
            elif message.get("method") == "Runtime.consoleAPICalled":
                params = message["params"]
                if params.get("type") == "error":
                    args = " ".join(
                        str(a.get("value", a.get("description"))) for a in params["args"]
                    )
                    self.errors.append(f"console.error: {args}")

    async def send(self, method: str, **params: Any) -> Any:
        ident = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        await self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        return await asyncio.wait_for(future, 30)

    async def goto(self, url: str) -> None:
        """Navigate and wait until that document has loaded."""
        await self.send("Page.navigate", url=url)
        # Compared without the fragment: a page may consume it (the dashboard's token does).
        base = json.dumps(url.split("#", maxsplit=1)[0])
        await self.wait_for(
            f"location.href.split('#')[0] === {base} && document.readyState === 'complete'"
        )

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CDPError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 15.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout_s}s: {expression}")
            await asyncio.sleep(0.1)

    async def click(self, selector: str) -> None:
        found = await self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " if (!el) return false; el.click(); return true; })()"
        )
        if not found:
            raise CDPError(f"nothing matches {selector}")

    async def screenshot(self, path: Path, width: int) -> Path:
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        await asyncio.sleep(0.3)  # let the charts redraw at the new size
        shot = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._ws.close()


async def _devtools_port(profile: Path, proc: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"chromium exited with {proc.returncode}; see {profile}/chromium.log"
            )
        if marker.exists():
            lines = marker.read_text().split()
            if lines:
                return int(lines[0])
        await asyncio.sleep(0.05)
    raise TimeoutError("chromium did not open its DevTools port within 30 s")


@contextlib.asynccontextmanager
async def chromium(width: int = 1600, height: int = 1000) -> AsyncIterator[Page]:
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed")
    profile = Path(tempfile.mkdtemp(prefix="shapegate-chromium-"))
    log = (profile / "chromium.log").open("wb")
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"],
        stdout=log,
        stderr=log,
    )
    page: Page | None = None
    try:
        port = await _devtools_port(profile, proc)
        async with httpx.AsyncClient(trust_env=False) as client:
            targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        ws = await websockets.connect(url, max_size=None, proxy=None)
        page = Page(ws)
        await page.send("Runtime.enable")
        await page.send("Page.enable")
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        yield page
    finally:
        if page is not None:
            await page.close()
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)

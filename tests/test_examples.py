"""examples/: the SSE server, the FastAPI app and the websocket chat app, run as real processes on the
tiny model; the chat page itself is driven in headless Chromium (CI installs it: .ci/run; elsewhere the
browser test is skipped when none is installed, and fails in CI, where ``CI=true``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shutil
import signal
import struct
import sys
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import aiohttp
import pytest
from http_helpers import free_port, sse_json, wait_http_ok

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def log(tmp_path) -> Iterator[IO[str]]:
    with open(tmp_path / "example.log", "w") as f:
        yield f


@contextlib.asynccontextmanager
async def example(script: str, log: IO[str]) -> AsyncIterator[str]:
    """Run ``examples/<script> --tiny`` on a free port; yields its URL; SIGTERM must end it with 0."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLES / script), "--tiny", "--port", str(port),
        stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http_ok(f"{url}/", proc=proc)
        yield url
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0, Path(log.name).read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def streams_a_chat_answer(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(f"{url}/generate", json={"prompt": CHAT, "max_new_tokens": 8}) as resp:
        chunks = await sse_json(resp)
    assert chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in chunks) == 8


@pytest.mark.extras  # a process on the real model (~10 s): CI's extras step
async def test_sse_server_example_streams_a_chat_answer(log):
    async with example("sse_server.py", log) as url, aiohttp.ClientSession() as session:
        await streams_a_chat_answer(session, url)


@pytest.mark.extras  # a process on the real model (~10 s): CI's extras step
async def test_fastapi_example_streams_answers_and_reports_metrics(log):
    async with example("fastapi_app.py", log) as url, aiohttp.ClientSession() as session:
        await streams_a_chat_answer(session, url)
        async with session.post(f"{url}/ask", json={"question": "hi", "max_new_tokens": 4}) as resp:
            assert resp.status == 200
            assert (await resp.json())["finish_reason"] in ("length", "eos")
        async with session.get(f"{url}/metrics") as resp:
            assert 'acb_requests_finished_total{finish_reason="length"} 1' in await resp.text()


@pytest.mark.extras  # a process on the real model (~10 s): CI's extras step
async def test_websocket_chat_example_serves_the_page_and_streams(log):
    async with example("websocket_chat/app.py", log) as url, aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            assert "new WebSocket" in await resp.text()
        async with session.ws_connect(f"{url}/ws") as ws:
            await ws.send_json({"type": "generate", "id": 1, "prompt": CHAT, "max_new_tokens": 1000,
                                "ignore_eos": True})
            await ws.receive_json()
            await ws.send_json({"type": "cancel", "id": 1})
            while not (msg := await asyncio.wait_for(ws.receive_json(), 10))["finish_reason"]:
                pass
            assert msg["finish_reason"] == "cancelled"


# ---------------------------------------------------------------- the page in a browser
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


class Page:
    """Just enough of the Chrome DevTools Protocol to load a page and evaluate JavaScript."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.last_id = 0

    async def call(self, method: str, **params) -> dict:
        self.last_id += 1
        await self.ws.send_json({"id": self.last_id, "method": method, "params": params})
        while (msg := await asyncio.wait_for(self.ws.receive_json(), 30)).get("id") != self.last_id:
            pass  # an event
        return msg.get("result", {})

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_until(self, expression: str, timeout: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not await self.eval(expression):
            if loop.time() > deadline:
                state = await self.eval("document.body && document.body.outerHTML")
                raise AssertionError(f"timed out waiting for {expression}; page: {state}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def browser_page(tmp_path: Path, chromium: str) -> AsyncIterator[Page]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        chromium, "--headless", "--window-size=1000,700", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        f"--remote-debugging-port={port}", f"--user-data-dir={tmp_path / 'chromium'}", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_http_ok(f"http://127.0.0.1:{port}/json/version", timeout=60, proc=proc)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                target = next(t for t in await resp.json() if t["type"] == "page")
            async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        proc.terminate()
        await proc.wait()


def png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values in the pixel data) of a PNG: enough to tell a
    rendered page from a blank or broken image without an imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    return size[0], size[1], len(set(zlib.decompress(idat)))


@pytest.fixture
def chromium() -> str:
    """The browser's path. CI must have it (.ci/run installs Debian's chromium): there a missing
    browser fails the test instead of skipping it."""
    if CHROMIUM is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("no Chromium installed, and CI must run the browser test (.ci/run installs it)")
        pytest.skip("no headless Chromium installed (apt-get install chromium)")
    return CHROMIUM


@pytest.mark.extras  # a real browser (~15 s): CI's extras step, which installs Chromium
async def test_chat_page_streams_an_answer_and_stops_one_in_chromium(log, tmp_path, chromium):
    async with example("websocket_chat/app.py", log) as url, browser_page(tmp_path, chromium) as page:
        await page.call("Page.navigate", url=f"{url}/?prompt=Hello&max_new_tokens=12&temperature=0")
        await page.wait_until("document.body.dataset.finishReason === 'length'")
        assert await page.eval("document.querySelector('.msg.user').textContent") == "Hello"
        answer = await page.eval("document.querySelector('.msg.assistant').textContent")
        assert answer
        # The page as a user sees it, kept under the test's tmp dir: the answer is in the rendered DOM
        shot = base64.b64decode((await page.call("Page.captureScreenshot", format="png"))["data"])
        (tmp_path / "chat-page.png").write_bytes(shot)
        width, height, colours = png_size_and_colours(shot)
        assert width > 0 and height > 0 and colours > 2, "the screenshot is blank"
        shown = await page.eval("document.getElementById('log').innerText")
        assert "Hello" in shown and answer.strip()[:8] in shown

        # greedy: this answer runs past 900 tokens without an end-of-sequence token
        await page.call("Page.navigate", url=f"{url}/?prompt=Tell%20me%20more&max_new_tokens=900&temperature=0")
        await page.wait_until("document.body.dataset.state === 'streaming'")
        await page.eval("document.getElementById('stop').click()")
        await page.wait_until("document.body.dataset.finishReason === 'cancelled'")


@pytest.mark.extras  # a process on the real model (~12 s), as README's quick start in the default suite
def test_minimal_stream_example_prints_an_answer():
    import subprocess

    out = subprocess.run([sys.executable, str(EXAMPLES / "minimal_stream.py"), "--tiny"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


@pytest.mark.extras  # a process on SmolLM2; the processors' behaviour: tests/test_logits_processors.py
def test_banned_words_example_keeps_the_words_out_of_one_answer():
    import subprocess

    out = subprocess.run([sys.executable, str(EXAMPLES / "banned_words.py"), "--tiny"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr  # (it exits 1 if a banned word is in the processed answer)
    free, banned = out.stdout.splitlines()[-2:]
    assert free.startswith("without a processor:") and banned.startswith("banning ['a', 'e', 'o']:")


@pytest.mark.extras  # a process on the real model (~10 s): CI's extras step
def test_stream_chat_example_prints_a_throughput_line():
    import subprocess

    out = subprocess.run([sys.executable, str(EXAMPLES / "stream_chat.py"), "--tiny", "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "tok/s" in out.stdout.splitlines()[-1]


@pytest.mark.extras  # a process on the real model (~10 s): CI's extras step
def test_acb_testing_example_passes_under_pytest():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(EXAMPLES / "test_with_acb_testing.py")], capture_output=True, text=True, timeout=180,
                         cwd=EXAMPLES.parent, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout

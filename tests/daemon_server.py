"""A real laneserve HTTP server on loopback for the daemon tests: the same `Server` the
`serve` command runs, on its own event loop in a background thread, over an engine the
test builds (so it can inject faults and stalls) and on a free port; or `laneserve serve`
itself as a process (`launch_serve`)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading

import aiohttp

from daemon.app import Server, ServerConfig, Serving, make_serving
from families.lfm2.config import generation_defaults
from lanes.client import EngineClient
from lanes.engine import Engine
from tests.priced import tiny_engine

SERVE = [sys.executable, "-c", "from daemon.cli import entry; entry()", "serve", "--port", "0"]


def launch_serve(*flags: str) -> tuple[subprocess.Popen, threading.Event, list[str], list[str]]:
    """`laneserve serve FLAGS` on a free port, not awaited: the process, an event set once it
    logs `serving on` (or exits), its address (one item, once known) and its log so far
    (kept filling in the background)."""
    process = subprocess.Popen([*SERVE, *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log, address, ready = [], [], threading.Event()

    def read():
        for line in process.stderr:
            log.append(line)
            if (found := re.search(r"serving on (http://\S+)", line)) and not address:
                address.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    return process, ready, address, log


def build_serving(target_dir, drafter_dir=None, streams: int = 16, queue: int = 64, max_model_len: int | None = None,
                  stall_seconds: float = 30.0, draft_width: int | None = None,
                  name: str = "tiny") -> tuple[Serving, Engine]:
    """An engine thread serving a tiny checkpoint, with its generation_config.json's
    sampling defaults as `serve` reads them. With a drafter, every round drafts: each lane
    verifies `draft_width - 1` drafts, or without a width every draft is priced in
    (tests.priced), so drafted rounds happen on any machine."""
    engine = tiny_engine(target_dir, drafter_dir, streams, max_waiting=queue, draft_width=draft_width)
    client = EngineClient(engine, stall_seconds=stall_seconds)
    client.start()
    assert client.wait_ready(30)
    limit = max_model_len or engine.target.context_limit
    defaults = generation_defaults(target_dir)
    return make_serving(client, engine.tokenizer, engine.target.vocab_size, name, limit, defaults), engine


class LiveServer:
    """`serving` None: a server whose model is still loading."""

    def __init__(self, serving: Serving | None, config: ServerConfig | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-http", daemon=True)
        self.thread.start()
        self.serving = serving
        self.server = self.call(self._make(config or ServerConfig(serving.front.model_name)))
        host, port = self.call(self.server.listen("127.0.0.1", 0))
        if serving is not None:
            self.server.attach(serving)
        self.url = f"http://{host}:{port}"

    @staticmethod
    async def _make(config: ServerConfig) -> Server:
        return Server(config)

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Run a coroutine on the server's loop without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.call(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def sse_lines(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> list[bytes]:
    """Every non-empty line of an SSE response, as sent."""
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return [line.rstrip(b"\n") async for line in response.content if line.strip()]


def http(method: str, url: str, body=None, headers: dict | None = None, data: bytes | None = None):
    """One request from synchronous test code: (status, headers, body bytes)."""

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.request(method, url, json=body, data=data, headers=headers) as response:
                return response.status, dict(response.headers), await response.read()

    return asyncio.run(go())

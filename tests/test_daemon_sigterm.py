"""`laneserve serve` as a process: it starts on a free port, and SIGTERM under load drains it
(ready and new requests 503, short streams finish, long ones end with an error event and
[DONE]) and it exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading

import aiohttp
import pytest

from families.lfm2.tiny_drafter import make_tiny_drafter

ENTRY = "from daemon.cli import entry; entry()"


@pytest.fixture(scope="module")
def drafter_dir(dense_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("sigterm_drafter"), dense_dir, seed=5, block_size=4)


def start(*flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """The server process, its address once it logs `serving on`, and its log so far (kept
    filling in the background)."""
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, "serve", "--port", "0", *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log, ready = [], threading.Event()
    address = []

    def read():
        for line in proc.stderr:
            log.append(line)
            if (found := re.search(r"serving on (http://\S+)", line)) and not address:
                address.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(60) or not address:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(log))
    return proc, address[0], log


def test_sigterm_under_load_ends_every_stream_with_done_and_exits_0(dense_dir, drafter_dir):
    proc, url, log = start("--model", str(dense_dir), "--draft-model", str(drafter_dir), "--served-model-name", "tiny",
                           "--max-streams", "4", "--drain-timeout", "1.0")
    try:
        async def stream(session, max_tokens: int, started: asyncio.Event) -> list[bytes]:
            lines = []
            async with session.post(url + "/v1/completions",
                                    json={"prompt": [1, 20, 30, 40], "max_tokens": max_tokens, "stream": True}) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.strip():
                        lines.append(line.rstrip(b"\n"))
                        started.set()
            return lines

        async def main():
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.create_task(stream(session, n, e)) for n, e in zip((6, 3000, 3000, 3000), started)]
                for event in started:
                    await event.wait()
                proc.send_signal(signal.SIGTERM)
                # Draining: not ready, and new work is refused with 503 in OpenAI's shape.
                while (await session.get(url + "/ready")).status != 503:
                    await asyncio.sleep(0.01)
                async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as refused:
                    assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
                return await asyncio.gather(*streams)

        results = asyncio.run(main())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert all(lines[-1] == b"data: [DONE]" for lines in results)
    short, *long = [[json.loads(line[6:]) for line in lines if line.startswith(b"data: {")] for lines in results]
    assert short[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    for events in long:
        assert "shutting down" in events[-1]["error"]["message"]
    text = "".join(log)
    for fact in ("model ", "drafter ", "lanes: 4 streams", "context: 4096 tokens", "serving on", "draining", "stopped"):
        assert fact in text
    assert re.search(r"cmpl-\w+ POST /v1/completions 200 .* prompt=4 completion=\d+ ttft=", text)

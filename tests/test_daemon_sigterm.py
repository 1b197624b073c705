"""`laneserve serve` as a process: it starts on a free port, and SIGTERM under load drains it
(ready and new requests 503, short streams finish, long ones end with an error event and
[DONE]) and it exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess

import aiohttp
import pytest

from families.lfm2.tiny_drafter import make_tiny_drafter
from tests.daemon_server import launch_serve


@pytest.fixture(scope="module")
def drafter_dir(dense_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("sigterm_drafter"), dense_dir, seed=5, block_size=4)


def start(*flags: str) -> tuple[subprocess.Popen, str, list[str]]:
    """The server process, its address once it logs `serving on`, and its log so far (kept
    filling in the background)."""
    proc, ready, address, log = launch_serve(*flags)
    if not ready.wait(60) or not address:
        proc.kill()
        pytest.fail("the server did not start:\n" + "".join(log))
    return proc, address[0], log


def gauge(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"laneserve:{name}{{"))


def test_sigterm_under_load_ends_every_stream_with_done_and_exits_0(dense_dir, drafter_dir):
    # One lane: a short stream runs while long ones queue behind it, more than the drain
    # deadline lets the lane serve, whatever this machine's speed or the replies' lengths.
    proc, url, log = start("--model", str(dense_dir), "--draft-model", str(drafter_dir), "--served-model-name", "tiny",
                           "--max-streams", "1", "--drain-timeout", "0.5")
    try:
        async def stream(session, max_tokens: int) -> list[bytes]:
            async with session.post(url + "/v1/completions",
                                    json={"prompt": [1, 20, 30, 40], "max_tokens": max_tokens, "stream": True}) as r:
                assert r.status == 200
                return [line.rstrip(b"\n") async for line in r.content if line.strip()]

        async def main():
            async with aiohttp.ClientSession() as session:
                async def until(name: str, value: int) -> None:
                    while gauge(await (await session.get(url + "/metrics")).text(), name) < value:
                        await asyncio.sleep(0.01)

                short = asyncio.create_task(stream(session, 40))
                await until("num_requests_running", 1)
                queued = [asyncio.create_task(stream(session, 3000)) for _ in range(8)]
                await until("num_requests_waiting", 7)
                proc.send_signal(signal.SIGTERM)
                # Draining: not ready, and new work is refused with 503 in OpenAI's shape.
                while (await session.get(url + "/ready")).status != 503:
                    await asyncio.sleep(0.01)
                async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as refused:
                    assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
                return await short, await asyncio.gather(*queued)

        short, queued = asyncio.run(main())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert short[-1] == b"data: [DONE]" and all(lines[-1] == b"data: [DONE]" for lines in queued)
    events = lambda lines: [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert events(short)[-1]["choices"][0]["finish_reason"] == "length"
    cut = [e[-1] for e in map(events, queued) if "error" in e[-1]]
    assert len(cut) >= 6 and all("shutting down" in e["error"]["message"] for e in cut)
    text = "".join(log)
    for fact in ("model ", "drafter ", "lanes: up to 1 per round", "drafted rounds: one at a time", "context: 4096 tokens",
                 "serving on", "draining", "stopped"):
        assert fact in text
    assert re.search(r"cmpl-\w+ POST /v1/completions 200 .* prompt=4 completion=40 ttft=", text)

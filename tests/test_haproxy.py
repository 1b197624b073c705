"""Two laneserve instances behind HAProxy (deploy/haproxy/haproxy.cfg), on loopback.

32 concurrent streams spread over both; then one instance drains on SIGTERM: its running
streams finish, HAProxy takes it out of the pool (health checks on /ready) and sends
new requests to the other, and no request fails. A restarted instance rejoins, and
drains again while requests keep arriving: those it refuses are retried on the other.
deploy/haproxy/run-local.sh starts and stops the same setup. Runs where HAProxy is installed."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy/haproxy/haproxy.cfg"
RUN_LOCAL = REPO / "deploy/haproxy/run-local.sh"
# Debian installs it in /usr/sbin, which is not on every user's PATH.
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (Debian: apt-get install haproxy; .ci/run installs it)")

LOOPBACK = "127.0.0.1"
SERVE = [sys.executable, "-m", "daemon.cli", "serve", "--host", LOOPBACK, "--max-streams", "16", "--drain-timeout", "120"]
# Streams that outlast the drained instance's exit from the pool (about 2 s: two failed
# checks a second apart) by a wide margin, whatever the load on this machine.
LONG_SECONDS = 8
# The tiny target's greedy reply to this runs past 2,500 tokens without an end token.
LONG_PROMPT = "Count to one thousand."
LONG_MAX = 2400


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind((LOOPBACK, 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def environment(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PATH"] = f"{Path(HAPROXY).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def start_instance(model: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*SERVE, "--model", str(model), "--port", str(port)], cwd=REPO, env=environment(),
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


async def wait_ready(session: aiohttp.ClientSession, port: int, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"laneserve on port {port} exited with {process.returncode}"
        try:
            async with session.get(f"http://{LOOPBACK}:{port}/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"port {port} not ready after {timeout} s")


async def stream(session: aiohttp.ClientSession, port: int, max_tokens: int, started: asyncio.Event | None = None,
                 prompt: str = "Tell me a story.") -> dict:
    """One streamed chat completion: its status, serving instance, finish reason, token
    count and whether it ended with [DONE] and no error event."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    result = {"status": None, "instance": None, "finish_reason": None, "done": False, "error": None,
              "completion_tokens": None}
    async with session.post(f"http://{LOOPBACK}:{port}/v1/chat/completions", json=body) as r:
        result["status"], result["instance"] = r.status, r.headers.get("X-Laneserve-Instance")
        if r.status != 200:
            result["error"] = await r.text()
            return result
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                result["error"] = chunk["error"]
                continue
            if chunk.get("usage"):
                result["completion_tokens"] = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
                if started is not None and choice["delta"].get("content"):
                    started.set()
    return result


def succeeded(r: dict) -> bool:
    return r["status"] == 200 and r["done"] and r["error"] is None and r["finish_reason"] in ("stop", "length")


async def successes(session: aiohttp.ClientSession, port: int) -> float:
    async with session.get(f"http://{LOOPBACK}:{port}/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "laneserve:request_success" for sample in family.samples
               if sample.name.endswith("_total"))


async def server_stats(session: aiohttp.ClientSession, stats: int) -> dict[str, dict]:
    """HAProxy's rows for the backend and each server (status, stot = sessions sent so
    far, check_status / check_code of the last health check, wredis = redispatches)."""
    async with session.get(f"http://{LOOPBACK}:{stats}/stats;csv") as r:
        text = (await r.text()).lstrip("# ")
    return {row["svname"]: row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == "laneserve"}


async def both_up(session: aiohttp.ClientSession, stats: int) -> bool:
    try:
        rows = await server_stats(session, stats)
    except aiohttp.ClientError:  # HAProxy not listening yet
        return False
    return all(rows[f"laneserve{i}"]["status"] == "UP" for i in (1, 2))


async def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@dataclass
class Cluster:
    """Two instances (laneserve1, laneserve2) and HAProxy with the shipped configuration."""

    model: Path
    logs: Path
    ports: list[int]
    front: int
    stats: int
    instances: list[subprocess.Popen] = field(default_factory=list)  # the current process of each
    processes: list[subprocess.Popen] = field(default_factory=list)  # every process started
    log_paths: dict[int, Path] = field(default_factory=dict)  # by pid

    def start(self, i: int) -> subprocess.Popen:
        path = self.logs / f"laneserve{i + 1}-{len(self.processes)}.log"
        process = start_instance(self.model, self.ports[i], path)
        self.processes.append(process)
        self.log_paths[process.pid] = path
        if i < len(self.instances):
            self.instances[i] = process
        else:
            self.instances.append(process)
        return process

    def log(self, process: subprocess.Popen) -> str:
        return self.log_paths[process.pid].read_text()


@pytest.fixture
def cluster(dense_dir, tmp_path):
    """Starts the cluster; stops whatever is left of it."""
    a, b, front, stats = free_ports(4)
    c = Cluster(dense_dir, tmp_path, [a, b], front, stats)
    c.start(0), c.start(1)
    c.processes.append(subprocess.Popen(
        [HAPROXY, "-db", "-f", str(CONFIG)], stdout=(tmp_path / "haproxy.log").open("wb"), stderr=subprocess.STDOUT,
        env=environment(LANESERVE_1=f"{LOOPBACK}:{a}", LANESERVE_2=f"{LOOPBACK}:{b}",
                        LANESERVE_LISTEN=f"{LOOPBACK}:{front}", HAPROXY_STATS=f"{LOOPBACK}:{stats}")))
    try:
        yield c
    finally:
        for p in c.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in c.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_two_instances_share_streams_and_one_drains_without_a_failed_request(cluster):
    async def scenario():
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            for port, process in zip(cluster.ports, cluster.instances):
                await wait_ready(session, port, process)
            await wait_for(lambda: both_up(session, cluster.stats), 10, "HAProxy to see both instances up")
            await spread_over_both(session, cluster)
            long = await drain_leaves_the_pool_by_health_check(session, cluster)
            await restarted_instance_rejoins_and_drains_under_requests(session, cluster, long)
    asyncio.run(scenario())


async def spread_over_both(session, c: Cluster) -> None:
    """32 concurrent streams: HAProxy fills both instances' 16 slots by least connections."""
    replies = await asyncio.gather(*(stream(session, c.front, 16) for _ in range(32)))
    assert all(succeeded(r) for r in replies), [r for r in replies if not succeeded(r)]
    served = [await successes(session, port) for port in c.ports]  # each instance's own count
    assert sum(served) == 32 and min(served) > 0, served
    assert {r["instance"] for r in replies} == {"laneserve1", "laneserve2"}


async def long_length(session, c: Cluster) -> int:
    """A max_tokens that keeps 8 streams going for about LONG_SECONDS at the pace measured
    now (a token costs more as a stream grows, so they last longer: the safe side)."""
    paced_from = time.monotonic()
    await asyncio.gather(*(stream(session, c.front, 128, prompt=LONG_PROMPT) for _ in range(8)))
    return min(LONG_MAX, max(256, round(LONG_SECONDS * 128 / (time.monotonic() - paced_from))))


async def sigterm_and_wait_draining(session, process: subprocess.Popen, port: int) -> None:
    process.send_signal(signal.SIGTERM)

    async def draining():
        async with session.get(f"http://{LOOPBACK}:{port}/ready") as r:
            return r.status == 503
    await wait_for(draining, 5, "the drained instance's /ready to turn 503")


async def drain_leaves_the_pool_by_health_check(session, c: Cluster) -> int:
    """SIGTERM laneserve1 while it streams: its /ready check takes it out of the pool with
    no request sent meanwhile, new requests go to laneserve2 only, its streams run to
    their end, and it exits 0."""
    long = await long_length(session, c)
    started = [asyncio.Event() for _ in range(8)]
    runs = [asyncio.create_task(stream(session, c.front, long, e, LONG_PROMPT)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    assert int((await server_stats(session, c.stats))["laneserve1"]["scur"]) > 0, "no stream on laneserve1"
    victim = c.instances[0]
    await sigterm_and_wait_draining(session, victim, c.ports[0])

    async def out_of_pool():
        return (await server_stats(session, c.stats))["laneserve1"]["status"].startswith("DOWN")
    await wait_for(out_of_pool, 5, "HAProxy to take the draining instance out of the pool")
    row = (await server_stats(session, c.stats))["laneserve1"]
    assert (row["check_status"], row["check_code"]) == ("L7STS", "503")  # taken out by its /ready check
    assert victim.poll() is None, "the instance exited before HAProxy noticed; make its streams longer"

    late = await asyncio.gather(*(stream(session, c.front, 8) for _ in range(8)))
    assert (await server_stats(session, c.stats))["laneserve1"]["stot"] == row["stot"]  # nothing more sent to it
    replies = await asyncio.gather(*runs)
    for r in late + replies:
        assert succeeded(r), r
    assert {r["instance"] for r in late} == {"laneserve2"}
    assert {r["instance"] for r in replies} == {"laneserve1", "laneserve2"}
    # Every stream on the drained instance ran to its natural end, not to the drain's cut-off.
    assert all(r["completion_tokens"] == long and r["finish_reason"] == "length" for r in replies), long
    assert victim.wait(timeout=60) == 0
    return long


async def restarted_instance_rejoins_and_drains_under_requests(session, c: Cluster, long: int) -> None:
    """A new laneserve1 on the same port rejoins the pool once /ready passes. SIGTERM it
    while a stream holds it open and requests keep arriving before any check runs: the
    ones it refuses with 503 are retried on laneserve2, and none fails."""
    restarted = c.start(0)
    await wait_ready(session, c.ports[0], restarted)

    async def rejoined():
        return (await server_stats(session, c.stats))["laneserve1"]["status"] == "UP"
    await wait_for(rejoined, 10, "HAProxy to bring the restarted instance back")
    held = asyncio.Event()
    holding = asyncio.create_task(stream(session, c.ports[0], long, held, LONG_PROMPT))  # directly, not via HAProxy
    await asyncio.wait_for(held.wait(), 30)
    before = (await server_stats(session, c.stats))["BACKEND"]
    await sigterm_and_wait_draining(session, restarted, c.ports[0])
    burst = await asyncio.gather(*(stream(session, c.front, 8) for _ in range(16)))
    for r in [*burst, await holding]:
        assert succeeded(r), r
    assert {r["instance"] for r in burst} == {"laneserve2"}
    after = (await server_stats(session, c.stats))["BACKEND"]
    assert int(after["wredis"]) > int(before["wredis"]), "no request met the draining instance; nothing was retried"
    assert restarted.wait(timeout=60) == 0
    assert "POST /v1/chat/completions 503" in c.log(restarted)  # it refused some, and HAProxy retried them


def test_run_local_starts_two_instances_behind_haproxy_and_drains_them_on_exit(dense_dir, tmp_path):
    a, b, front, stats = free_ports(4)
    out = tmp_path / "run-local.out"
    script = subprocess.Popen(
        [str(RUN_LOCAL), "--model", str(dense_dir)], cwd=REPO, stdout=out.open("wb"), stderr=subprocess.STDOUT,
        env=environment(LANESERVE=f"{sys.executable} -m daemon.cli", LANESERVE_PORTS=f"{a} {b}", LOG_DIR=str(tmp_path),
                        LANESERVE_LISTEN=f"{LOOPBACK}:{front}", HAPROXY_STATS=f"{LOOPBACK}:{stats}"))
    try:
        deadline = time.monotonic() + 60
        while "ready: " not in out.read_text():
            assert script.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        pids = [int(line.split(" pid ")[1].split()[0]) for line in out.read_text().splitlines() if " pid " in line]
        assert len(pids) == 2

        async def two_requests():
            async with aiohttp.ClientSession() as session:
                await wait_for(lambda: both_up(session, stats), 10, "HAProxy to see both instances up")
                return await asyncio.gather(*(stream(session, front, 8) for _ in range(2)))
        assert all(succeeded(r) for r in asyncio.run(two_requests()))

        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 128 + signal.SIGTERM
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for port in (a, b):
            assert "stopped" in (tmp_path / f"laneserve-{port}.log").read_text()  # drained, not killed
        with pytest.raises(OSError):
            socket.create_connection((LOOPBACK, front), timeout=1).close()  # HAProxy is gone too
    finally:
        if script.poll() is None:
            script.kill()

"""Load runs over HTTP against OpenAI-compatible servers, side by side.

    python -m bench.bench_concurrent --url [NAME=]URL [--url [NAME=]URL2 ...] --streams 1,4,8,16
        [--prompts FILE|builtin] [--distinct|--same] [--max-tokens N] [--draft on|off|both]
        [--rounds R] [--min-seconds S] [--out DIR] [--model NAME] [--endpoint chat|completions] [--time-budget S]
        [--max-tokens-spread F]

A cell is one server, one draft setting and one stream count N: N workers each keep one
streamed request in flight, so exactly N streams are in flight from the cell's start
until its last measured request ends. `--max-tokens-spread F` draws each request's
max_tokens from max_tokens x (1 - F) .. x (1 + F), the k-th request of every cell the
same draw: replies of one length keep the streams of a server that emits a token per
lane per round in step, so they all end in one round and their next prompts are read
together, where requests in service end and arrive apart (and a drafting server's lanes
drift apart on their own). Workers start measured requests for
`--min-seconds`; after that they send unmeasured ones only while a measured request is
still running (so the streams stay full to the end), and the cell ends when those
finish. Cells alternate in rounds: within a round every stream count runs every
setting in turn (the order of settings rotates from round to round), so each ratio is
taken between cells that ran minutes apart at most, on the same machine state.

A server whose /metrics has `spec_decode_num_drafts` (laneserve, vLLM) is sent the
extension field `draft`; one without (mlx_lm.server, which has no /metrics and ignores
the field) runs once per stream count, without it. Before the rounds every server
reads every prompt once with `draft: false` (this warms it up, and is what the
measurement-only scripted drafter records; see bench/serve_scripted.py), and a drafting
server runs one untimed batch with drafting on.

Per cell: request and output throughput, per-stream output tok/s, TTFT, TPOT, ITL and
end-to-end latency (mean, median, std, p90, p99), failures by status, and where the
server counts them the deltas of its speculative-decoding counters and rounds by kind
(bench/serving_metrics.py has the arithmetic; bench/openai_stream.py how tokens are
counted per SSE chunk). Writes under --out: bench_concurrent.json (every cell, and per
server / draft / streams the median, min and max over rounds), bench_concurrent.md (a
table) and bench_concurrent.png (plots), each with the command, commit and machine; the
JSON is rewritten after every cell, so a run cut short leaves what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from .concurrent_report import markdown, summarize, write_report
from .openai_stream import RequestSpec, Sampling, scrape, stream, token_counting
from .prompts import load_prompts
from .provenance import provenance
from .serving_metrics import (
    RequestRecord,
    cell_metrics,
    counter_deltas,
    has_spec_decode,
    rounds_by_kind,
    spec_decode_metrics,
)


@dataclass(frozen=True)
class Server:
    label: str
    url: str
    has_metrics: bool
    drafting: bool  # honours the `draft` field (it counts speculative decoding)
    counting: str  # how its chunks tell their token counts (openai_stream.token_counting)


@dataclass(frozen=True)
class Setting:
    server: Server
    draft: bool | None  # None: the field is not sent

    @property
    def label(self) -> str:
        return self.server.label if self.draft is None else f"{self.server.label} draft {'on' if self.draft else 'off'}"


def parse_url(text: str) -> tuple[str, str]:
    """`NAME=URL` or `URL` (named by host:port)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        url = text
        name = urlsplit(url).netloc
    return name, url.rstrip("/")


async def probe(session: aiohttp.ClientSession, label: str, url: str, sample: RequestSpec) -> Server:
    counters = await scrape(session, url)
    counting = await token_counting(session, url, sample)
    return Server(label, url, counters is not None, counters is not None and has_spec_decode(counters), counting)


def settings_of(servers: list[Server], draft: str) -> list[Setting]:
    drafts = {"on": [True], "off": [False], "both": [False, True]}[draft]
    return [Setting(s, d) for s in servers for d in (drafts if s.drafting else [None])]


class Progress:
    """One status line on stderr: redrawn in place on a terminal, a line per cell otherwise."""

    def __init__(self, cells: int):
        self.cells = cells
        self.done = 0
        self.tty = sys.stderr.isatty()

    def show(self, label: str, streams: int, round_: int, elapsed: float, records: list[RequestRecord], final: bool = False) -> None:
        tokens = sum(r.output_tokens for r in records if r.ok)
        line = (f"[{self.done + final}/{self.cells}] round {round_ + 1} {label} x{streams}: {elapsed:5.1f} s, "
                f"{len(records)} requests, {tokens / max(elapsed, 1e-9):7.1f} tok/s")
        if self.tty:
            print("\r" + line.ljust(110), end="\n" if final else "", file=sys.stderr, flush=True)
        elif final:
            print(line, file=sys.stderr, flush=True)
        if final:
            self.done += 1


class Runner:
    def __init__(self, args, session: aiohttp.ClientSession, prompts: list[str]):
        self.args = args
        self.session = session
        self.prompts = prompts

    def spec(self, k: int, setting: Setting, longest: bool = False) -> RequestSpec:
        """The k-th request of a cell; `longest`: with the most tokens any request may ask
        for (priming: the scripted drafter then records every reply whole)."""
        index = k % len(self.prompts) if self.args.distinct else 0
        # A prompt keeps its seed, so its reply is the one the priming pass recorded.
        sampling = Sampling(self.args.temperature, self.args.seed + index if self.args.temperature > 0 else None)
        logprobs = 0 if setting.server.counting == "logprobs" else None
        low, high = max_tokens_range(self.args.max_tokens, self.args.max_tokens_spread)
        max_tokens = high if longest else random.Random(f"{self.args.seed}:{k}").randint(low, high)
        return RequestSpec(self.prompts[index], max_tokens, sampling, setting.draft, self.args.endpoint, self.args.model, logprobs)

    async def untimed(self, setting: Setting, count: int, concurrency: int) -> list[RequestRecord]:
        gate = asyncio.Semaphore(concurrency)

        async def one(k: int) -> RequestRecord:
            async with gate:
                return (await stream(self.session, setting.server.url, self.spec(k, setting, longest=True))).record

        return await asyncio.gather(*(one(k) for k in range(count)))

    async def prime(self, servers: list[Server], concurrency: int) -> None:
        """Every prompt once with drafting off, then one drafted batch where drafting applies."""
        for server in servers:
            plain = Setting(server, False if server.drafting else None)
            started = time.perf_counter()
            records = await self.untimed(plain, len(self.prompts) if self.args.distinct else concurrency, concurrency)
            failed = [r for r in records if not r.ok]
            print(f"primed {plain.label}: {len(records)} requests in {time.perf_counter() - started:.1f} s"
                  + (f", {len(failed)} failed: {failed[0].error}" if failed else ""), file=sys.stderr, flush=True)
            if failed and len(failed) == len(records):
                raise SystemExit(f"{server.label} ({server.url}) answered no request: {failed[0].error}")
            if server.drafting and self.args.draft != "off":
                await self.untimed(Setting(server, True), concurrency, concurrency)

    async def cell(self, setting: Setting, streams: int, round_: int, progress: Progress) -> dict:
        url, min_seconds = setting.server.url, self.args.min_seconds
        before = await scrape(self.session, url) if setting.server.has_metrics else None
        records: list[RequestRecord] = []
        numbers = itertools.count()
        measured_running = 0
        start = time.perf_counter()
        deadline = start + min_seconds

        async def worker() -> None:
            nonlocal measured_running
            # Whether the next request is measured goes by when this worker's last one
            # ended (the clock its record keeps), so the last measured request ends at or
            # after the deadline and the window lasts at least min_seconds.
            ready = start
            while True:
                measured = ready < deadline
                if not measured and measured_running == 0:
                    return
                measured_running += measured
                result = await stream(self.session, url, self.spec(next(numbers), setting), measured)
                measured_running -= measured
                records.append(result.record)
                ready = result.record.ended
                if not result.record.ok:
                    await asyncio.sleep(0.1)  # a server refusing at once would otherwise be hammered
                    ready = time.perf_counter()

        async def redraw() -> None:
            while True:
                progress.show(setting.label, streams, round_, time.perf_counter() - start, records)
                await asyncio.sleep(0.5)

        painter = asyncio.create_task(redraw()) if progress.tty else None
        await asyncio.gather(*(worker() for _ in range(streams)))
        if painter is not None:
            painter.cancel()
        progress.show(setting.label, streams, round_, time.perf_counter() - start, records, final=True)
        result = {"server": setting.server.label, "url": url, "draft": setting.draft, "setting": setting.label,
                  "streams": streams, "round": round_ + 1} | cell_metrics(records, streams, start)
        if before is not None:
            after = await scrape(self.session, url)
            deltas = counter_deltas(before, after or {})
            result |= spec_decode_metrics(deltas) | {"rounds_by_kind": rounds_by_kind(deltas)}
        return result


def max_tokens_range(max_tokens: int, spread: float) -> tuple[int, int]:
    """The least and most tokens a request asks for: max_tokens x (1 -/+ spread), at least 1."""
    return max(1, round(max_tokens * (1 - spread))), max(1, round(max_tokens * (1 + spread)))


def write(out: Path, result: dict, final: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    result["summary"] = summarize(result["cells"], result["baseline"])
    (out / "bench_concurrent.json").write_text(json.dumps(result, indent=2) + "\n")
    if final:
        write_report(out, result)


async def run(args) -> dict:
    prompts = load_prompts(args.prompts)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    out = Path(args.out)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        sample = RequestSpec(prompts[0], 8, endpoint=args.endpoint, model=args.model)
        servers = [await probe(session, *parse_url(u), sample) for u in args.url]
        for s in servers:
            print(f"{s.label} ({s.url}): /metrics {'yes' if s.has_metrics else 'no'}, "
                  f"drafting {'counted, `draft` sent' if s.drafting else 'not counted, `draft` not sent'}, "
                  f"tokens per chunk from {s.counting}", file=sys.stderr)
        settings = settings_of(servers, args.draft)
        result = {
            **args.provenance,
            "servers": [{"label": s.label, "url": s.url, "metrics": s.has_metrics, "drafting": s.drafting,
                         "token_counting": s.counting} for s in servers],
            "settings": [s.label for s in settings],
            "baseline": settings[0].label,
            "prompts": args.prompts, "prompt_count": len(prompts), "distinct": args.distinct,
            "endpoint": args.endpoint, "max_tokens": args.max_tokens, "max_tokens_spread": args.max_tokens_spread,
            "temperature": args.temperature,
            "min_seconds": args.min_seconds, "rounds": args.rounds, "rounds_run": 0, "streams": args.streams,
            "cells": [],
        }
        runner = Runner(args, session, prompts)
        began = time.perf_counter()
        await runner.prime(servers, max(args.streams))
        progress = Progress(args.rounds * len(args.streams) * len(settings))
        rounds_began = time.perf_counter()
        for round_ in range(args.rounds):
            now = time.perf_counter()
            if args.time_budget and round_ > 0 and now - began + (now - rounds_began) / round_ > args.time_budget:
                print(f"stopping after {round_} round(s): another would pass --time-budget {args.time_budget:.0f} s",
                      file=sys.stderr, flush=True)
                break
            order = settings[round_ % len(settings):] + settings[: round_ % len(settings)]
            for streams in args.streams:
                for setting in order:
                    result["cells"].append(await runner.cell(setting, streams, round_, progress))
                    write(out, result, final=False)
            result["rounds_run"] = round_ + 1
    write(out, result, final=True)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="[NAME=]URL of a server (repeatable)")
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--prompts", default="builtin", help="'builtin' or a prompts file (see bench/prompts.py)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--distinct", dest="distinct", action="store_true", default=True,
                       help="each request takes the next prompt, cycling (default)")
    order.add_argument("--same", dest="distinct", action="store_false", help="every request sends the first prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-tokens-spread", type=float, default=0.0,
                   help="each request asks for max_tokens x (1 - F) .. x (1 + F) tokens, drawn per request (0: all alike)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="with --temperature > 0: prompt i is sent with seed SEED + i")
    p.add_argument("--draft", choices=["on", "off", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=10.0, help="measured requests start for this long per cell")
    p.add_argument("--out", default="bench/results/concurrent")
    p.add_argument("--model", help="the request's `model` field (default: left out, each server's own model)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--time-budget", type=float, help="start no round that would end past this many seconds from the "
                   "start (estimated from the rounds so far; the first always runs)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if not 0 <= args.max_tokens_spread < 1:
        p.error(f"--max-tokens-spread must be at least 0 and below 1, got {args.max_tokens_spread}")
    args.provenance = provenance(sys.argv[1:] if argv is None else argv, __spec__.name)
    result = asyncio.run(run(args))
    print(markdown(result))


if __name__ == "__main__":
    main()

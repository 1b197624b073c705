"""Drafted replies equal plain ones, and concurrent replies equal solo ones, token for token.

    python -m bench.exact --url URL [--prompts FILE|builtin] [--streams 16] [--max-tokens 64]
        [--temperature 0.8] [--seed 1234] [--endpoint chat|completions] [--out FILE]

For greedy decoding and for seeded sampling (request i sends seed SEED + i), the first
`--streams` prompts are sent four ways: solo with `draft: false` (the reference: the
target alone, one stream), solo with `draft: true`, all at once with `draft: true` and all
at once with `draft: false`. Every reply must equal its reference token for token (by
the tokens' bytes in the logprobs the requests ask for, `top_logprobs` 2) and in its
finish reason. Each mismatch is printed with its first differing position and the
target's top-2 logprob margin there in both replies: a margin near zero is a near-tie,
where another summation order may pick the other token; a wide one is a bug. Where the
server has /metrics, the check also says how much it drafted meanwhile (a check that
drafted nothing proved little). Exit status 1 on any mismatch or failed request. The JSON
report (--out) carries the command, commit and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .openai_stream import (
    RequestSpec,
    Sampling,
    StreamResult,
    TokenLogprob,
    scrape,
    stream,
)
from .prompts import load_prompts
from .provenance import provenance
from .serving_metrics import counter_deltas, spec_decode_metrics


@dataclass
class Mismatch:
    mode: str
    prompt: int
    way: str
    position: int
    reply: str  # the reply's token (or text) there
    reference: str
    margin: float | None  # top-2 logprob margin of the reply there
    reference_margin: float | None

    def line(self) -> str:
        margins = f"top-2 margin {_margin(self.margin)} (reference {_margin(self.reference_margin)})"
        return (f"MISMATCH {self.mode} prompt {self.prompt} {self.way}: first differs at token {self.position}: "
                f"{self.reply!r} vs reference {self.reference!r}; {margins}")


def _margin(m: float | None) -> str:
    return "n/a" if m is None else f"{m:.4f}"


def top2_margin(entry: TokenLogprob | None) -> float | None:
    """logprob of the best alternative minus the second's: how far from a tie the target was."""
    if entry is None or len(entry.top) < 2:
        return None
    return entry.top[0][1] - entry.top[1][1]


def first_difference(reply: StreamResult, reference: StreamResult) -> tuple[int, str, str] | None:
    """Where two replies part: (token position, reply's token, reference's token), or None
    when they are equal (tokens, text and finish reason). Compares tokens by their logprobs
    entries when both replies carry them, else characters of text."""
    if reply.logprobs and reference.logprobs:
        a, b = [t.identity for t in reply.logprobs], [t.identity for t in reference.logprobs]
        show = lambda entries, i: entries[i].token if i < len(entries) else "<end>"
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i] != b[i]:
                return i, show(reply.logprobs, i), show(reference.logprobs, i)
    else:
        for i in range(max(len(reply.text), len(reference.text))):
            if reply.text[i : i + 1] != reference.text[i : i + 1]:
                return i, reply.text[i : i + 16], reference.text[i : i + 16]
    if reply.text != reference.text or reply.finish_reason != reference.finish_reason:
        n = len(reply.logprobs)
        return n, f"text/finish {reply.finish_reason}", f"text/finish {reference.finish_reason}"
    return None


def compare(mode: str, prompt: int, way: str, reply: StreamResult, reference: StreamResult) -> Mismatch | None:
    found = first_difference(reply, reference)
    if found is None:
        return None
    i, mine, theirs = found
    at = lambda r: r.logprobs[i] if i < len(r.logprobs) else None
    return Mismatch(mode, prompt, way, i, mine, theirs, top2_margin(at(reply)), top2_margin(at(reference)))


async def replies(session, url: str, specs: list[RequestSpec], concurrent: bool) -> list[StreamResult]:
    if concurrent:
        return list(await asyncio.gather(*(stream(session, url, s) for s in specs)))
    return [await stream(session, url, s) for s in specs]


async def run(args) -> dict:
    prompts = load_prompts(args.prompts)
    chosen = [prompts[i % len(prompts)] for i in range(args.streams)]
    modes = {"greedy": lambda i: Sampling(0.0), "seeded": lambda i: Sampling(args.temperature, args.seed + i)}
    report = {"url": args.url, "streams": args.streams, "max_tokens": args.max_tokens, "compared": 0,
              "mismatches": [], "failures": [], "logprobs": True}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await scrape(session, args.url)
        for mode, sampling in modes.items():
            def specs(draft: bool, sampling=sampling) -> list[RequestSpec]:
                return [RequestSpec(p, args.max_tokens, sampling(i), draft, args.endpoint, args.model, top_logprobs=2)
                        for i, p in enumerate(chosen)]

            reference = await replies(session, args.url, specs(False), concurrent=False)
            ways = {
                "solo draft on": await replies(session, args.url, specs(True), concurrent=False),
                "concurrent draft on": await replies(session, args.url, specs(True), concurrent=True),
                "concurrent draft off": await replies(session, args.url, specs(False), concurrent=True),
            }
            for way, results in [("solo draft off", reference), *ways.items()]:
                for i, r in enumerate(results):
                    if not r.record.ok:
                        report["failures"].append(f"{mode} prompt {i} {way}: status {r.record.status}: {r.record.error}")
            for way, results in ways.items():
                for i, (reply, ref) in enumerate(zip(results, reference)):
                    if not (reply.record.ok and ref.record.ok):
                        continue
                    report["compared"] += 1
                    report["logprobs"] &= bool(reply.logprobs and ref.logprobs)
                    mismatch = compare(mode, i, way, reply, ref)
                    if mismatch is not None:
                        report["mismatches"].append(mismatch)
            tokens = sum(len(r.logprobs) for r in reference)
            print(f"{mode}: {len(chosen)} prompts, {tokens} reference tokens, "
                  f"{sum(m.mode == mode for m in report['mismatches'])} mismatches", file=sys.stderr, flush=True)
        if before is not None:
            report["spec_decode"] = spec_decode_metrics(counter_deltas(before, await scrape(session, args.url) or {}))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--prompts", default="builtin")
    p.add_argument("--streams", type=int, default=16, help="prompts sent at once in the concurrent passes")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="of the seeded sampling pass")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--model", help="the request's `model` field (default: left out)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", help="also write the report as JSON here")
    args = p.parse_args(argv)
    args.url = args.url.rstrip("/")
    record = provenance(sys.argv[1:] if argv is None else argv, __spec__.name)
    report = {**record, **asyncio.run(run(args))}
    for failure in report["failures"]:
        print(f"FAILED {failure}")
    for m in report["mismatches"]:
        print(m.line())
    if not report["logprobs"]:
        print("note: the server sent no logprobs; replies were compared by text")
    spec = report.get("spec_decode")
    if spec and spec["spec_decode_num_drafts"] is not None:
        print(f"meanwhile the server drafted in {spec['spec_decode_num_drafts']:.0f} lane-rounds: "
              f"{spec['spec_decode_accepted_tokens']:.0f} of {spec['spec_decode_draft_tokens']:.0f} draft tokens accepted")
    verdict = "exact" if not report["mismatches"] and not report["failures"] else "NOT exact"
    print(f"{verdict}: {report['compared'] - len(report['mismatches'])}/{report['compared']} replies equal their reference "
          f"(solo, draft off), {len(report['failures'])} failed requests")
    if args.out:
        report["mismatches"] = [vars(m) for m in report["mismatches"]]
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if verdict == "exact" else 1


if __name__ == "__main__":
    sys.exit(main())

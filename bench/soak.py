"""Soak the engine boundary: thousands of short requests through `EngineClient` with random
cancels, stop strings, sampling, repetition penalties, logprobs and draft on/off, from one
asyncio loop.

Reports requests per second, errors (must be 0; cancels are not errors), whether every
request got exactly one final event, what the engine still holds afterwards (must be
nothing), memory before and after: resident, and MLX's arrays alive (`mlx_active`: growth
beyond the prefix cache's bytes is a leak) and its allocator's cache of freed buffers
(`mlx_cache`, bounded by MLX's cache limit), and
`mismatches` (must be 0): prompts come from a small pool that shares prefixes, and every
greedy or seeded request that ran to its end without a stop string must continue the
same prompt and sampling exactly as every other such request did, whatever batch,
drafting, prefix-cache hit or round kind it met.

    python -m bench.soak [--model DIR --draft-model DIR] [--requests 3000] [--concurrency 24] [--prompt-lookup N]
                         [--overlap auto|on|off] [--always-draft] [--prefix-cache-mib N] [--out FILE]

Without --model it soaks the embedded default with its drafter. `--overlap on` forces
overlapped drafted rounds (lanes/round.py) with CUDA's steady shapes where they would not
be the default, as on the CPU, so their bookkeeping meets cancels, joins and ends; this
tests their logic, not their timing. The JSON report (--out) carries the command, commit
and machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time

import mlx.core as mx

from bench.provenance import provenance
from bench.scripted import AlwaysDraft
from daemon.cli import DEFAULT_PROMPT_LOOKUP, exit_process
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.drafter import load_drafter
from lanes.client import EngineClient
from lanes.engine import Engine, EngineConfig, QueueFull
from lanes.lane import FinishReason, Request
from lanes.sampling import SamplingParams

STOPS = ("the", ".", "\n", "ing")


def memory_mib() -> dict[str, float]:
    """Resident memory, MLX's live arrays and its allocator's cache, MiB."""
    return {"rss": round(rss_mib(), 1), "mlx_active": round(mx.get_active_memory() / 2**20, 1),
            "mlx_cache": round(mx.get_cache_memory() / 2**20, 1)}


def rss_mib() -> float:
    """Resident memory now, MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def prompt_pool(rng: random.Random, vocab: int, size: int = 24) -> list[list[int]]:
    """`size` prompts over a few shared openings, some longer than a prefix-cache block, so
    that repeats and prefix-cache hits occur."""
    openings = [[1] + [rng.randrange(20, vocab) for _ in range(rng.choice([rng.randrange(2, 40), rng.randrange(64, 160)]))]
                for _ in range(size // 4)]
    return [rng.choice(openings) + [rng.randrange(20, vocab) for _ in range(rng.randrange(0, 24))] for _ in range(size)]


def random_request(rng: random.Random, prompts: list[list[int]]) -> Request:
    penalty = 1.2 if rng.random() < 0.25 else 1.0
    sampling = SamplingParams(repetition_penalty=penalty) if rng.random() < 0.5 else SamplingParams(
        temperature=rng.choice([0.5, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=penalty, seed=rng.randrange(3))  # few seeds: seeded replies repeat
    stop = (rng.choice(STOPS),) if rng.random() < 0.3 else ()
    logprobs = rng.choice([0, 2]) if rng.random() < 0.1 else None
    return Request(list(rng.choice(prompts)), rng.randrange(1, 24), sampling, stop, draft=rng.random() < 0.7, logprobs=logprobs)


class Replies:
    """The longest reply seen for each (prompt, sampling) that ran to its end unstopped by a
    stop string; a reply that is not a prefix of it, or it of the reply, is a mismatch."""

    def __init__(self):
        self.longest: dict[tuple, list[int]] = {}
        self.compared = 0
        self.mismatches: list[dict] = []

    def check(self, request: Request, tokens: list[int]) -> None:
        key = (tuple(request.prompt), request.sampling)
        seen = self.longest.setdefault(key, tokens)
        short, long = sorted((seen, tokens), key=len)
        self.compared += seen is not tokens
        if long[: len(short)] != short:
            self.mismatches.append({"prompt": request.prompt, "sampling": repr(request.sampling), "draft": request.draft,
                                    "before": seen, "now": tokens})
        elif len(tokens) > len(seen):
            self.longest[key] = tokens


async def soak(client: EngineClient, requests: int, concurrency: int, seed: int, prompts: list[list[int]],
               replies: Replies) -> dict:
    rng = random.Random(seed)
    outcome: dict[str, int] = {}
    final_events = {"missing": 0, "extra": 0}
    retries = 0
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal retries
        async with slots:
            request = random_request(rng, prompts)
            cancel_after = rng.random() * 0.02 if rng.random() < 0.15 else None
            while True:
                try:
                    handle = client.submit(request)
                    break
                except QueueFull:
                    retries += 1
                    await asyncio.sleep(0.005)
            if cancel_after is not None:
                asyncio.get_running_loop().call_later(cancel_after, handle.cancel)
            finals, tokens = 0, []
            async for event in handle:
                finals += event.finish_reason is not None
                tokens += event.token_ids
            final_events["missing" if finals == 0 else "extra"] += finals != 1
            reason = event.finish_reason.value
            if reason in (FinishReason.LENGTH.value, FinishReason.STOP.value) and not request.stop:
                replies.check(request, tokens)
            outcome[reason] = outcome.get(reason, 0) + 1
            if i % 200 == 0:
                print(f"\r{i}/{requests} requests", end="", file=sys.stderr, flush=True)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.perf_counter() - started
    print(file=sys.stderr)
    return {"requests": requests, "seconds": round(seconds, 2), "requests_per_second": round(requests / seconds, 1),
            "finish_reasons": outcome, "errors": outcome.get(FinishReason.ERROR.value, 0),
            "final_event_faults": final_events, "queue_full_retries": retries, "replies_compared": replies.compared,
            "mismatches": len(replies.mismatches), "first_mismatches": replies.mismatches[:3]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--draft-model")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-streams", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP,
                   help=f"prompt lookup beside the drafter, as `serve` runs it (default {DEFAULT_PROMPT_LOOKUP}; 0 off)")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="overlapped drafted rounds: the backend's default, forced on (as on CUDA: steady shapes, "
                        "priced without live timing), or off")
    p.add_argument("--always-draft", action="store_true",
                   help="draft every round the lanes can (the guards' timing on random prompts would keep most plain)")
    p.add_argument("--prefix-cache-mib", type=int, default=64, help="prefix cache budget (0 off)")
    p.add_argument("--out", help="write the report as JSON here too")
    args = p.parse_args(argv)
    record = provenance(sys.argv[1:] if argv is None else argv, __spec__.name)
    if args.model is None:
        args.model, args.draft_model = default_target_dir(), args.draft_model or default_drafter_dir()
    dtype = "float32" if mx.default_device() == mx.cpu else None
    loaded = open_target(args.model, dtype=dtype, max_lanes=args.max_streams)
    drafter = None
    if args.draft_model:
        drafter = load_drafter(args.draft_model, loaded.target.model, loaded.target.config, dtype=dtype, max_lanes=args.max_streams)
    overlap = {"auto": {}, "on": {"overlap": True, "steady_shapes": True, "price_live": False}, "off": {"overlap": False}}[args.overlap]
    config = EngineConfig(max_streams=args.max_streams, prompt_lookup=args.prompt_lookup,
                          prefix_cache_bytes=args.prefix_cache_mib << 20, **overlap)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, config)
    if args.always_draft:
        engine.rounds.guard = AlwaysDraft()
    client = EngineClient(engine)
    client.start(warm_up=drafter is not None)
    client.wait_ready()
    prompts, replies = prompt_pool(random.Random(args.seed), loaded.target.vocab_size), Replies()
    # One short pass first, so caches, pools and allocators reach their working size.
    asyncio.run(soak(client, 64, args.concurrency, args.seed + 1, prompts, replies))
    before = memory_mib()
    report = asyncio.run(soak(client, args.requests, args.concurrency, args.seed, prompts, replies))
    # The last final events reach the loop before the engine retires their lanes.
    deadline = time.monotonic() + 5
    while client.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = client.stats()
    after = memory_mib()
    client.shutdown(5)
    report = {**record, **report}
    report.update(memory_mib_before=before, memory_mib_after=after,
                  held_after={k: stats[k] for k in ("in_flight", "queue_depth", "running", "waiting", "kv_bytes_in_use")},
                  model=str(args.model), drafter=str(args.draft_model), max_streams=args.max_streams,
                  overlap=args.overlap, always_draft=args.always_draft, prefix_cache_mib=args.prefix_cache_mib,
                  rounds_by_mode=stats["rounds_by_mode"], prefix_cache=stats.get("prefix_cache"))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    clean = (report["errors"] == 0 and report["mismatches"] == 0 and not any(report["final_event_faults"].values())
             and not any(report["held_after"].values()))
    return 0 if clean else 1


if __name__ == "__main__":
    exit_process(main())

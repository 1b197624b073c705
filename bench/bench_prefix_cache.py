"""The prefix cache on a multi-turn chat: time to first token per turn with the cache on
and off, and decode throughput when every request misses.

    python -m bench.bench_prefix_cache --out bench/results/NAME [--model DIR --drafter DIR] [--turns 8]

Two engines of the same checkpoint (and drafter, when there is one) run side by side in
one process, one with the prefix cache (its budget from free memory unless `--budget`)
and one without, each warmed up as `laneserve serve` warms up. Each alternation, in
turn order on then off, then off then on:

- a conversation of `--turns` turns: every turn sends the whole conversation so far (the
  earlier prompts and replies) plus a new user message of `--user-tokens` tokens, and
  the model replies with up to `--reply-tokens` tokens (greedy). The two engines get
  different conversations of the same shape, so the first turn misses in both. Time to
  first token (submission to first token) is recorded per turn;
- a decode cell on each engine: `--lanes` streams with fresh prompts (every lookup
  misses) decoding for at least `--min-seconds`, tokens per second of the whole batch
  (prefill, decode and, with the cache, recording conv states at block boundaries and
  offering the finished lanes' blocks). The cell decodes plainly, so the guards'
  choices (noisy where a drafter's acceptance is) do not blur the cache's upkeep.

Token ids are drawn at random from the tokenizer's range: time to first token depends on
lengths, not on content. Writes NAME.json and NAME.md with command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.provenance import markdown_line, median_range, provenance, spread, write_result
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.drafter import load_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.prefix_cache import default_budget_bytes


def engine_of(args, budget: int, lanes: int) -> Engine:
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=lanes)
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, loaded.target.model, loaded.target.config, dtype=args.dtype, max_lanes=lanes)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter,
                    EngineConfig(max_streams=lanes, prefix_cache_bytes=budget))
    engine.warm_up()
    return engine


def random_ids(engine: Engine, rng: np.random.Generator, n: int) -> list[int]:
    """Ids the tokenizer knows (a random checkpoint pads its embedding past them), past the specials."""
    vocab = min(engine.target.vocab_size, engine.tokenizer.vocab_size)
    return [int(t) for t in rng.integers(16, vocab, n)]


def conversation(engine: Engine, rng: np.random.Generator, args) -> list[dict]:
    """One chat, turn by turn: prompt length, cached tokens and time to first token."""
    history, turns = [], []
    for _ in range(args.turns):
        prompt = history + random_ids(engine, rng, args.user_tokens)
        (done,) = engine.generate([Request(prompt, args.reply_tokens)])
        turns.append({"prompt_tokens": len(prompt), "cached_tokens": done.cached_tokens, "ttft_s": done.timings.ttft_seconds})
        history = prompt + done.token_ids
    return turns


def decode_cell(engine: Engine, rng: np.random.Generator, args) -> float:
    """Tokens per second of fresh batches (every prompt new) over at least --min-seconds."""
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.min_seconds:
        requests = [Request(random_ids(engine, rng, args.prompt_tokens), args.gen_tokens, draft=False) for _ in range(args.lanes)]
        tokens += sum(len(done.token_ids) for done in engine.generate(requests))
    return tokens / (time.perf_counter() - started)


def run(args) -> dict:
    record = provenance()
    engines = {"off": engine_of(args, 0, args.lanes)}
    # The budget is taken once one engine is loaded, as `laneserve serve` takes it.
    engines["on"] = engine_of(args, args.budget if args.budget is not None else default_budget_bytes(), args.lanes)
    chats = {"on": [], "off": []}
    decode = {"on": [], "off": []}
    for k in range(args.alternations):
        order = ("on", "off") if k % 2 == 0 else ("off", "on")
        for mode in order:
            rng = np.random.default_rng([args.seed, k, mode == "on"])
            chats[mode].append(conversation(engines[mode], rng, args))
            print(f"alternation {k + 1}/{args.alternations} {mode:>3}: last turn TTFT {chats[mode][-1][-1]['ttft_s'] * 1e3:.1f} ms "
                  f"({chats[mode][-1][-1]['cached_tokens']} of {chats[mode][-1][-1]['prompt_tokens']} tokens cached)", flush=True)
        for mode in order:
            decode[mode].append(decode_cell(engines[mode], np.random.default_rng([args.seed, k, 2, mode == "on"]), args))
        print(f"alternation {k + 1}/{args.alternations} decode: on {decode['on'][-1]:.1f} tok/s, off {decode['off'][-1]:.1f} tok/s", flush=True)
    turns = []
    for t in range(args.turns):
        on = [c[t]["ttft_s"] for c in chats["on"]]
        off = [c[t]["ttft_s"] for c in chats["off"]]
        turns.append({
            "turn": t + 1,
            "prompt_tokens": statistics.median(c[t]["prompt_tokens"] for c in chats["on"]),
            "cached_tokens": statistics.median(c[t]["cached_tokens"] for c in chats["on"]),
            "ttft_on_s": spread(on), "ttft_off_s": spread(off),
            "speedup": spread([b / a for a, b in zip(on, off)]),
        })
    return {
        **record,
        "model": str(args.model), "drafter": str(args.drafter) if args.drafter else None, "dtype": args.dtype,
        "budget_bytes": engines["on"].prefix_cache.budget_bytes, "block_tokens": engines["on"].prefix_cache.block_tokens,
        "turns": args.turns, "user_tokens": args.user_tokens, "reply_tokens": args.reply_tokens, "alternations": args.alternations,
        "per_turn": turns,
        "decode": {"lanes": args.lanes, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                   "min_seconds": args.min_seconds, "on_tok_s": spread(decode["on"]), "off_tok_s": spread(decode["off"]),
                   "ratio": spread([a / b for a, b in zip(decode["on"], decode["off"])])},
        "raw": {"chats": chats, "decode": decode},
        "prefix_cache": engines["on"].stats()["prefix_cache"],
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Prefix cache: {result['turns']}-turn chat, time to first token with the cache on and off", "",
        markdown_line(result),
        (f"- model {result['model']}, drafter {result['drafter']}, dtype {result['dtype'] or 'as stored'}; "
        f"budget {result['budget_bytes'] / 2**20:.0f} MiB, blocks of {result['block_tokens']} tokens"),
        (f"- each turn adds {result['user_tokens']} user tokens and up to {result['reply_tokens']} reply tokens; "
        f"{result['alternations']} alternations, median [min-max]"), "",
        "| turn | prompt tokens | cached | TTFT on (ms) | TTFT off (ms) | off / on |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in result["per_turn"]:
        lines.append(f"| {t['turn']} | {t['prompt_tokens']:.0f} | {t['cached_tokens']:.0f} | "
                     f"{median_range(t['ttft_on_s'], 1, scale=1e3)} | {median_range(t['ttft_off_s'], 1, scale=1e3)} | "
                     f"{median_range(t['speedup'], unit='x')} |")
    d = result["decode"]
    lines += ["", (f"Decode when every request misses ({d['lanes']} lanes, {d['prompt_tokens']}-token prompts, "
              f"{d['gen_tokens']} tokens each, cells of at least {d['min_seconds']:.0f} s):"), "",
              "| cache on (tok/s) | cache off (tok/s) | on / off |", "|---:|---:|---:|",
              f"| {median_range(d['on_tok_s'], 1)} | {median_range(d['off_tok_s'], 1)} | {median_range(d['ratio'], 3, 'x')} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results directory")
    parser.add_argument("--name", default="prefix-cache")
    parser.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--drafter", help="drafter directory (default: the embedded default's, with the default model; else none)")
    parser.add_argument("--dtype", help="cast the models to this dtype (default: as stored)")
    parser.add_argument("--budget", type=int, help="prefix cache bytes (default: a quarter of free memory)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=448)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--alternations", type=int, default=5)
    parser.add_argument("--lanes", type=int, default=8, help="streams of the decode cell")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt of each decode-cell stream")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens each decode-cell stream generates")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="decode cell length, at least")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model is None:
        args.model, args.drafter = default_target_dir(), args.drafter or default_drafter_dir()
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

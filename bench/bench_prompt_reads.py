"""Reading prompts of lengths never read before: what a fused-attention plan per shape
costs, and what laneserve's rule saves.

    python -m bench.bench_prompt_reads --model DIR --out bench/results/NAME [--length 1000] [--count 20] [--long 32768]

A backend that plans its fused attention per shape (cuDNN's, on CUDA) pays for a plan
the first time it meets each query and key length. laneserve's rule
(families/lfm2/model.py `fused_attention`) gives the fused kernel there only to prompt
chunks of a multiple of STEADY_QUERY rows, whose shapes recur from prompt to prompt, and
attends a prompt's last, partial chunk with matmuls. Two systems alternate in one
process, each turn reading prompts no system has read before, so every partial chunk is
a new shape:

- steady: laneserve's rule;
- every_shape: every chunk over SMALL_QUERY rows takes the fused kernel (the rule before).

Each turn of a system reads `--count` random prompts of about `--length` tokens and one
of about `--long` tokens (0: none), one token generated each, one lane. Reported: the
median milliseconds per short prompt and seconds for the long one over the
`--alternations` turns, with their spread, and the ratio taken per turn. The first turn
also pays for the plans of the full chunks, which later turns (and the other system)
reuse; systems take turns first in alternate order. Writes NAME.json and NAME.md
(`--name`, default prompt-reads) under --out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

import families.lfm2.model as lfm2_model
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.cache import plans_per_shape
from families.lfm2.checkpoint import default_target_dir
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request

SYSTEMS = {"steady": lfm2_model.STEADY_QUERY, "every_shape": 1}  # STEADY_QUERY 1: every length is "steady"


def run(args) -> dict:
    record = provenance()
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=1)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=1))
    rng = np.random.default_rng(args.seed)
    fresh = itertools.count(1)  # each prompt a length no one has read: a new partial chunk

    def read(length: int) -> float:
        prompt = [int(t) for t in rng.integers(20, loaded.target.vocab_size - 1, length + next(fresh))]
        started = time.perf_counter()
        engine.generate([Request(prompt, 1)])
        return time.perf_counter() - started

    read(args.length)  # the engine's own first-call costs, outside every turn
    turns = {name: {"short_ms": [], "long_s": []} for name in SYSTEMS}
    for turn in range(args.alternations):
        order = list(SYSTEMS) if turn % 2 == 0 else list(reversed(SYSTEMS))
        for name in order:
            lfm2_model.STEADY_QUERY = SYSTEMS[name]
            shorts = [read(args.length) for _ in range(args.count)]
            turns[name]["short_ms"].append(1e3 * statistics.median(shorts))
            if args.long:
                turns[name]["long_s"].append(read(args.long))
            print(f"turn {turn + 1} {name}: {turns[name]['short_ms'][-1]:.1f} ms per short prompt"
                  + (f", long {turns[name]['long_s'][-1]:.2f} s" if args.long else ""), flush=True)
    lfm2_model.STEADY_QUERY = SYSTEMS["steady"]
    result = {**record, "model": str(args.model), "dtype": args.dtype or "as stored", "plans_per_shape": plans_per_shape(),
              "length": args.length, "count": args.count, "long": args.long, "alternations": args.alternations,
              "steady_query": SYSTEMS["steady"], "systems": {}}
    for name, cells in turns.items():
        result["systems"][name] = {key: summary(values) for key, values in cells.items() if values}
    for key in ("short_ms", "long_s"):
        if turns["steady"][key]:
            ratios = [e / s for s, e in zip(turns["steady"][key], turns["every_shape"][key])]
            result.setdefault("every_shape_over_steady", {})[key] = summary(ratios)
    return result


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "turns": values}


def markdown(result: dict) -> str:
    def cell(s: dict, digits: int) -> str:
        return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

    lines = [
        markdown_line(result),
        "",
        (f"One lane, one token generated per prompt; every prompt a length not read before in the process. "
         f"Backend plans per shape: {result['plans_per_shape']}. Medians [min-max] over {result['alternations']} turns; "
         "ratios taken per turn."),
        "",
        "| system | ms per prompt of ~{} tokens (median of {}) | s per prompt of ~{} tokens |".format(
            result["length"], result["count"], result["long"] or "-"),
        "|---|---:|---:|",
    ]
    for name, s in result["systems"].items():
        lines.append(f"| {name} | {cell(s['short_ms'], 1)} | {cell(s['long_s'], 2) if 'long_s' in s else '-'} |")
    ratio = result.get("every_shape_over_steady", {})
    lines.append(f"| every_shape / steady | {cell(ratio['short_ms'], 2)}x | "
                 f"{cell(ratio['long_s'], 2) + 'x' if 'long_s' in ratio else '-'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_target_dir()))
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--length", type=int, default=1000, help="tokens of a short prompt, about")
    p.add_argument("--count", type=int, default=20, help="short prompts per turn")
    p.add_argument("--long", type=int, default=32768, help="tokens of the long prompt, about (0: none)")
    p.add_argument("--alternations", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="prompt-reads")
    args = p.parse_args()
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

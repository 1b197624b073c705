"""Reading prompts of lengths never read before: what a plan per shape costs, and what
laneserve's rules save.

    python -m bench.bench_prompt_reads --model DIR --out bench/results/NAME [--length 1000] [--count 20] [--long 32768]
        [--lanes 1]

A backend that plans per shape (cuDNN's fused attention and cuBLASLt's matmuls, on CUDA)
pays for a plan the first time it meets each shape. laneserve's rules: the fused
attention only for prompt chunks of a multiple of STEADY_QUERY rows, whose shapes recur
from prompt to prompt, a prompt's last, partial chunk attended with matmuls
(families/lfm2/model.py `fused_attention`); and since ac3607c every lane of a prompt
read padded to one steady width, so its matmuls meet a few row counts
(`Lfm2Target.steady_width`). Three systems alternate in one process, each turn reading
prompts of lengths from `--length` up to twice it, each a length no prompt had before until
they come round again (then in the same order), so partial chunks are new lengths until
the process has met them all, as in service:

- steady: laneserve's rules;
- every_shape: every chunk over SMALL_QUERY rows takes the fused kernel (the rule before);
- ragged_rows: each lane's rows as they come (before ac3607c).

Each turn of a system reads `--count` times `--lanes` random prompts of about `--length`
tokens, read together (lanes joining at once), and one of about `--long` tokens (0:
none), one token generated each. Reported: the median milliseconds per short read and
seconds for the long one over the `--alternations` turns, with their spread, and the
ratios to steady taken per turn. The first turn also pays for the plans of the full
chunks (and, steady, of its widths), which later turns reuse; systems take turns first
in rotating order. On a backend that plans nothing per shape (the CPU) the three run
alike. Writes NAME.json and NAME.md (`--name`, default prompt-reads) under
--out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

import families.lfm2.model as lfm2_model
from bench.provenance import markdown_line, median_range, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.cache import plans_per_shape
from families.lfm2.checkpoint import default_target_dir
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request

# Per system: the STEADY_QUERY in force (1: every length is "steady"), and whether prompt
# reads pad to steady widths.
SYSTEMS = {"steady": (lfm2_model.STEADY_QUERY, True), "every_shape": (1, True), "ragged_rows": (lfm2_model.STEADY_QUERY, False)}


def run(args) -> dict:
    record = provenance()
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=args.lanes)
    target = loaded.target
    engine = Engine(target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=args.lanes))
    rng = np.random.default_rng(args.seed)
    # Each prompt a length no one has read, a new partial chunk, until the lengths come round:
    # counting on without bound would take the short prompts to many times --length.
    fresh = {length: itertools.count(1) for length in (args.length, args.long)}
    lengths_read = []

    def read(length: int, lanes: int) -> float:
        sizes = [length + next(fresh[length]) % max(length, 1) for _ in range(lanes)]
        if length == args.length:
            lengths_read.extend(sizes)
        prompts = [[int(t) for t in rng.integers(20, target.vocab_size - 1, size)] for size in sizes]
        started = time.perf_counter()
        engine.generate([Request(prompt, 1) for prompt in prompts])
        return time.perf_counter() - started

    read(args.length, args.lanes)  # the engine's own first-call costs, outside every turn
    steady_width = target.steady_width
    turns = {name: {"short_ms": [], "long_s": []} for name in SYSTEMS}
    for turn in range(args.alternations):
        order = list(SYSTEMS)[turn % len(SYSTEMS):] + list(SYSTEMS)[: turn % len(SYSTEMS)]
        for name in order:
            lfm2_model.STEADY_QUERY, steady_widths = SYSTEMS[name]
            target.steady_width = steady_width if steady_widths else (lambda widths, bounds: None)
            shorts = [read(args.length, args.lanes) for _ in range(args.count)]
            turns[name]["short_ms"].append(1e3 * statistics.median(shorts))
            if args.long:
                turns[name]["long_s"].append(read(args.long, 1))
            print(f"turn {turn + 1} {name}: {turns[name]['short_ms'][-1]:.1f} ms per short read"
                  + (f", long {turns[name]['long_s'][-1]:.2f} s" if args.long else ""), flush=True)
    lfm2_model.STEADY_QUERY, target.steady_width = SYSTEMS["steady"][0], steady_width
    result = {**record, "model": str(args.model), "dtype": args.dtype or "as stored", "plans_per_shape": plans_per_shape(),
              "length": args.length, "count": args.count, "lanes": args.lanes, "long": args.long,
              "alternations": args.alternations, "steady_query": SYSTEMS["steady"][0],
              "short_prompts": len(lengths_read), "short_lengths": len(set(lengths_read)), "systems": {}, "over_steady": {}}
    for name, cells in turns.items():
        result["systems"][name] = {key: summary(values) for key, values in cells.items() if values}
        if name != "steady":
            result["over_steady"][name] = {key: summary([o / s for s, o in zip(turns["steady"][key], values)])
                                           for key, values in cells.items() if values}
    return result


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "turns": values}


def markdown(result: dict) -> str:
    lines = [
        markdown_line(result),
        "",
        (f"{result['lanes']} lane(s) per short read, one for the long one, one token generated per prompt; "
         f"{result['short_prompts']} short prompts of {result['short_lengths']} lengths, each new until they came round "
         f"again. Backend plans per shape: {result['plans_per_shape']}. Medians "
         f"[min-max] over {result['alternations']} turns; ratios taken per turn."),
        "",
        "| system | ms per read of {} prompt(s) of ~{} tokens (median of {}) | s per prompt of ~{} tokens |".format(
            result["lanes"], result["length"], result["count"], result["long"] or "-"),
        "|---|---:|---:|",
    ]
    for name, s in result["systems"].items():
        lines.append(f"| {name} | {median_range(s['short_ms'], 1)} | {median_range(s['long_s']) if 'long_s' in s else '-'} |")
    for name, ratio in result["over_steady"].items():
        lines.append(f"| {name} / steady | {median_range(ratio['short_ms'])}x | "
                     f"{median_range(ratio['long_s']) + 'x' if 'long_s' in ratio else '-'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_target_dir()))
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--length", type=int, default=1000, help="tokens of a short prompt, about")
    p.add_argument("--count", type=int, default=20, help="short reads per turn")
    p.add_argument("--lanes", type=int, default=1, help="prompts read together in a short read (lanes joining at once)")
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

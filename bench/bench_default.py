"""The embedded default: does its trained drafter get accepted, and does drafting pay?

    python -m bench.bench_default --out bench/results/NAME [--model DIR --drafter DIR] [--width 9] [--sampled] [--log FILE]
        [--cells 6] [--repeats 1] [--in-step-beside]

On the held-out prompts of bench/default_prompts.json (chat questions on held-out
dictionary and jargon entries, openings of held-out paragraphs), greedy (or, with
`--sampled`, at the checkpoint's generation_config.json sampling defaults with seed
1000 + the prompt's index), one stream at a time:

- mean accepted drafts per drafted round at the trained verify width, for the DSpark
  drafter and for a prompt-lookup n-gram baseline measured the same way (same engine,
  same width, same verification);
- decode tok/s: plain, DSpark at the fixed trained width, DSpark priced with guards, and
  DSpark priced with guards and prompt lookup beside it (as `laneserve generate` runs
  it), plain and drafted alternated per prompt. Over all prompts, and per cell: the
  prompts are dealt into `--cells` cells in turn (prompt i to cell i mod cells, so each
  holds a like mix of chat and text; each pass over them with `--repeats` its own), each
  engine's tok/s over a cell taken against plain's over the same cell, reported as the
  median [min-max] of those ratios. `--in-step-beside` adds the last of these with
  overlapped drafted rounds off (`EngineConfig.overlap`; on by default where the device
  runs behind the host, a GPU), in the same turns.

Every drafted output is checked against the plain one. `--log FILE` writes the lane
core's debug log (every round and guard decision), each engine's run of each prompt
headed by an `engine=NAME prompt=I` line; logging every round slows the run, so its
timings are for reading the log against, not for quoting. Writes NAME.json and NAME.md
under --out (`--name`; default: default, or default-sampled with `--sampled`), each with its command, commit
and machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx

from bench.lane_log import write_lane_core_log
from bench.prompt_lookup import PromptLookupDrafter
from bench.provenance import markdown_line, median_range, provenance, write_result
from daemon.cli import DEFAULT_PROMPT_LOOKUP
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.config import generation_defaults
from families.lfm2.drafter import load_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams

PROMPTS = Path(__file__).parent / "default_prompts.json"
log = logging.getLogger("laneserve.bench_default")


def encode(tokenizer, prompt: dict) -> list[int]:
    if "chat" in prompt:
        return tokenizer.encode_chat([{"role": "user", "content": prompt["chat"]}])
    return tokenizer.encode(prompt["text"])


def timed(engine: Engine, prompt: list[int], max_tokens: int, sampling: SamplingParams):
    started = time.perf_counter()
    (done,) = engine.generate([Request(prompt, max_tokens, sampling=sampling)])
    if done.error is not None:  # a failed reply is not a slow one
        raise RuntimeError(f"a reply ended in error: {done.error}")
    return done, time.perf_counter() - started


def run(args) -> dict:
    record = provenance()
    if args.dtype is None and mx.default_device() == mx.cpu:
        args.dtype = "float32"
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=1)
    target = loaded.target
    dspark = load_drafter(args.drafter, target.model, target.config, dtype=args.dtype, max_lanes=1)
    width = args.width or dspark.width + 1

    def engine(drafter=None, draft_width=None, prompt_lookup=0, overlap=None):
        e = Engine(target, loaded.tokenizer, loaded.eos_ids, drafter,
                   EngineConfig(max_streams=1, draft_width=draft_width, prompt_lookup=prompt_lookup, overlap=overlap))
        if drafter is not None and draft_width is None:
            e.warm_up()
        return e

    engines = {
        "plain": engine(),
        "dspark_fixed": engine(dspark, width),
        "dspark_priced": engine(dspark),
        "dspark_lookup_priced": engine(dspark, prompt_lookup=DEFAULT_PROMPT_LOOKUP),
        # It proposes from the host's tokens (bench/prompt_lookup.py): its rounds take one at a time.
        "ngram_fixed": engine(PromptLookupDrafter(target.vocab_size, width - 1, max_lanes=1), width, overlap=False),
    }
    if args.in_step_beside:
        engines["dspark_lookup_priced_in_step"] = engine(dspark, prompt_lookup=DEFAULT_PROMPT_LOOKUP, overlap=False)
    prompts = [encode(loaded.tokenizer, p) for p in json.loads(PROMPTS.read_text())["prompts"]]
    defaults = generation_defaults(args.model) if args.sampled else {}
    samplings = [SamplingParams(**defaults, seed=1000 + i if defaults else None) for i in range(len(prompts))]
    for e in engines.values():  # warm-up
        e.generate([Request(prompts[0], 8)])
    cells = args.cells * args.repeats
    tokens = {name: [0] * cells for name in engines}
    seconds = {name: [0.0] * cells for name in engines}
    accepted = {name: [] for name in engines}
    looked_up = {name: 0 for name in engines}
    exact = True
    for repeat in range(args.repeats):
        for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            cell = repeat * args.cells + i % args.cells
            plain, _ = timed(engines["plain"], prompt, args.max_tokens, sampling)
            for name, e in engines.items():
                log.debug("engine=%s prompt=%d", name, i)
                done, spent = timed(e, prompt, args.max_tokens, sampling)
                exact &= done.token_ids == plain.token_ids
                tokens[name][cell] += len(done.token_ids)
                seconds[name][cell] += spent
                accepted[name] += done.draft.accepted_per_round
                looked_up[name] += done.draft.looked_up_rounds
    sampling = {k: v for k, v in asdict(samplings[0]).items() if k != "seed"}
    result = {**record, "model": str(args.model), "drafter": str(args.drafter), "dtype": args.dtype or "as stored", "prompts": len(prompts), "max_tokens": args.max_tokens,
              "width": width, "sampling": sampling if defaults else "greedy", "exact": exact, "cells": args.cells,
              "repeats": args.repeats, "engines": {}}
    rate = {name: [t / s for t, s in zip(tokens[name], seconds[name])] for name in engines}
    overall = {name: sum(tokens[name]) / sum(seconds[name]) for name in engines}
    for name in engines:
        per_cell = [r / p for r, p in zip(rate[name], rate["plain"])]
        result["engines"][name] = {
            "tok_s": overall[name],
            "speedup": overall[name] / overall["plain"],
            "speedup_per_cell": {"median": statistics.median(per_cell), "min": min(per_cell), "max": max(per_cell), "cells": per_cell},
            "seconds": sum(seconds[name]),
            "mean_accepted_per_drafted_round": statistics.mean(accepted[name]) if accepted[name] else 0.0,
            "drafted_rounds": len(accepted[name]),
            "looked_up_rounds": looked_up[name],
        }
    return result


def markdown(result: dict) -> str:
    sampling = result["sampling"] if result["sampling"] == "greedy" else "sampled at " + ", ".join(f"{k} {v:g}" for k, v in result["sampling"].items())
    lines = [
        markdown_line(result),
        "",
        (f"{result['prompts']} held-out prompts, {sampling}, up to {result['max_tokens']} tokens, "
        f"one stream, {result['dtype']}; verify width {result['width']}; drafted outputs equal plain: {result['exact']}."),
        (f"Per cell: the prompts dealt into {result.get('cells', 1)} cells in turn, {result.get('repeats', 1)} pass(es), "
         "median [min-max] of each cell's tok/s against plain's over the same cell."),
        "",
        "| engine | tok/s | vs plain | vs plain per cell | accepted drafts per drafted round | drafted rounds | of them looked up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in result["engines"].items():
        cell = r.get("speedup_per_cell")
        spread = median_range(cell, unit="x") if cell else "-"
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {spread} | {r['mean_accepted_per_drafted_round']:.2f} "
                     f"| {r['drafted_rounds']} | {r['looked_up_rounds']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_target_dir())
    p.add_argument("--drafter", default=default_drafter_dir())
    p.add_argument("--out", required=True)
    p.add_argument("--name", help="base name of the result files (default: default, or default-sampled)")
    p.add_argument("--width", type=int, help="verify width (default: the drafter's trained block_size + 1)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="weights' dtype (default: as `laneserve generate` runs them, float32 on the CPU, as stored elsewhere)")
    p.add_argument("--sampled", action="store_true", help="sample at the checkpoint's generation_config.json defaults (default: greedy)")
    p.add_argument("--log", help="write the lane core's debug log (rounds, guard decisions) here")
    p.add_argument("--cells", type=int, default=6, help="cells the prompts are dealt into in turn, whose ratios give the spread")
    p.add_argument("--repeats", type=int, default=1, help="passes over the prompts (each pass its own cells)")
    p.add_argument("--in-step-beside", action="store_true",
                   help="also run the default engine with overlapped drafted rounds off, in the same turns")
    args = p.parse_args()
    if not 1 <= args.cells <= len(json.loads(PROMPTS.read_text())["prompts"]) or args.repeats < 1:
        p.error("--cells must be within 1..the number of prompts and --repeats at least 1")
    if args.log:
        write_lane_core_log(args.log)
    result = run(args)
    name = args.name or ("default-sampled" if args.sampled else "default")
    write_result(args.out, name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

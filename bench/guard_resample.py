"""The draft guard on a logged band's rounds, drawn again: what a guard's probes cost
where a band's rounds are alike from one to the next (the long contexts of bench_engine,
whose scripted acceptance is drawn afresh each round).

    python -m bench.guard_resample LOG[.gz] --contexts 32768,126000 --out DIR [--name guard-resample]
        [--tokens 6144] [--draws 40] [--budget 0.02] [--smoothing 0.05] [--max-probe-share 0.25]

LOG is a `bench_engine --log` (one lane). For each context C, the one-lane rounds logged
at C..C+`--tokens` are the band's samples: plain rounds' seconds (the plain engine's and
the drafting engine's alike), and drafted rounds' (probes included) emitted tokens and
seconds. A fresh guard then decodes `--tokens`
tokens `--draws` times, each round drawn at random from the samples of the choice it
made, and its time is set against decoding the same tokens plain at the plain samples'
mean seconds per token. Reported per context: that ratio (what a drafting-capable engine
keeps of plain's speed by its guard's choices alone, upkeep left out), the share of
rounds drafted, and the seconds lost to drafted rounds against plain, probes apart,
median and [min-max] over the draws. Every draw of one context uses the same seeds
whatever the guard's settings, so two runs with different settings compare side by side.
Writes NAME.json and NAME.md under --out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import random

from bench.provenance import markdown_line, median_range, provenance, spread, write_result
from bench.round_phases import open_log, rounds
from lanes.guard import DraftGuard


def band_samples(found: list[dict], context: int, tokens: int) -> tuple[list[float], list[tuple[float, float]]]:
    """The one-lane rounds logged at `context`..`context + tokens`: plain rounds' seconds
    and drafted rounds' (emitted, seconds), probes counted as drafted."""
    plain, drafted = [], []
    for r in found:
        if int(r["lanes"]) != 1 or not context <= r["context"] <= context + tokens:
            continue
        if r["kind"] == "plain":
            plain.append(r["seconds"])
        else:
            drafted.append((r["emitted"], r["seconds"]))
    if not plain or not drafted:
        raise SystemExit(f"error: the log holds no {'plain' if not plain else 'drafted'} one-lane rounds at context {context}")
    return plain, drafted


def draw(plain: list[float], drafted: list[tuple[float, float]], context: int, tokens: int, seed: int,
         guard_settings: dict) -> dict:
    """One guard decoding `tokens` tokens on rounds drawn from the samples."""
    rng = random.Random(seed)
    guard = DraftGuard(**guard_settings)
    emitted = seconds = drafted_seconds = probe_seconds = 0.0
    rounds_ = drafted_rounds = 0
    plain_rate = sum(plain) / len(plain)  # seconds per token of a plain round
    while emitted < tokens:
        decision = guard.decide(1, context + int(emitted))
        if decision.draft:
            got, took = rng.choice(drafted)
            lost = took - got * plain_rate
            if decision.probe:
                probe_seconds += lost
            else:
                drafted_seconds += lost
            drafted_rounds += 1
        else:
            got, took = 1.0, rng.choice(plain)
        guard.record(decision, took, got)
        emitted += got
        seconds += took
        rounds_ += 1
    return {"ratio": emitted * plain_rate / seconds, "drafted_share": drafted_rounds / rounds_,
            "probe_loss": probe_seconds / seconds, "drafted_loss": drafted_seconds / seconds}


def run(args) -> dict:
    record = provenance()
    with open_log(args.log) as f:
        found = rounds(f)
    settings = {"budget": args.budget, "smoothing": args.smoothing, "max_probe_share": args.max_probe_share}
    result = {**record, "log": args.log, "tokens": args.tokens, "draws": args.draws, "guard": settings, "contexts": {}}
    for context in args.contexts:
        plain, drafted = band_samples(found, context, args.tokens)
        draws = [draw(plain, drafted, context, args.tokens, seed, settings) for seed in range(args.draws)]
        cell = {"plain_samples": len(plain), "drafted_samples": len(drafted),
                "plain_tps": len(plain) / sum(plain), "drafted_tps": sum(e for e, _ in drafted) / sum(s for _, s in drafted)}
        cell.update({key: spread([d[key] for d in draws]) for key in ("ratio", "drafted_share", "probe_loss", "drafted_loss")})
        result["contexts"][context] = cell
        print(f"context {context}: ratio {median_range(cell['ratio'], 4)}, "
              f"drafted {cell['drafted_share']['median']:.1%}", flush=True)
    return result


def markdown(result: dict) -> str:
    guard = result["guard"]
    lines = [markdown_line(result), "",
             f"`{result['log']}`: {result['draws']} draws of {result['tokens']} tokens per context, one lane; the guard with "
             f"budget {guard['budget']}, smoothing {guard['smoothing']}, probe share at most {guard['max_probe_share']}. "
             "Ratio: plain's time for the tokens over the guarded run's; losses: what drafted rounds lost against plain, "
             "as a share of the run's time. Median [min-max] over the draws.", "",
             "| context | logged plain tok/s | logged drafted tok/s | ratio | drafted rounds | probes' loss | other drafted rounds' loss |",
             "|---:|---:|---:|---:|---:|---:|---:|"]

    for context, c in result["contexts"].items():
        lines.append(f"| {context} | {c['plain_tps']:.1f} | {c['drafted_tps']:.1f} | "
                     f"{median_range(c['ratio'], 3, 'x')} | "
                     f"{median_range(c['drafted_share'], 1, percent=True)} | "
                     f"{median_range(c['probe_loss'], 1, percent=True)} | "
                     f"{median_range(c['drafted_loss'], 1, percent=True)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--contexts", required=True, type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="guard-resample")
    p.add_argument("--tokens", type=int, default=6144, help="tokens decoded per draw (6 runs of 1024, as bench_engine's long rows)")
    p.add_argument("--draws", type=int, default=40)
    defaults = DraftGuard()
    p.add_argument("--budget", type=float, default=defaults.budget)
    p.add_argument("--smoothing", type=float, default=defaults.smoothing)
    p.add_argument("--max-probe-share", type=float, default=defaults.max_probe_share)
    args = p.parse_args()
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))


if __name__ == "__main__":
    main()

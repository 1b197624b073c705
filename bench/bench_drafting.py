"""The inputs of verify-window pricing: what a drafting round and a verify of w rows cost.

    python -m bench.bench_drafting --model DIR --drafter DIR --out bench/results/NAME [--lanes 1,4,16]

For L lanes at a fixed context it times, each the median of `--repeats` runs after a
warm-up, everything evaluated to completion:

- a plain target step (L rows, one per lane);
- one drafting round: the drafter appends one committed row per lane to its context,
  then proposes `block_size` drafts per lane (the batched forward, Markov chain and
  confidences); its ratio to the plain step is the overhead drafting must pay back
  (aim: under 30% at 1 lane);
- a verify forward of w = 1..W rows per lane (uncommitted, so the context stays put),
  as milliseconds and as a ratio to w = 1;
- a drafted round as the lane core runs it with one host sync: the append and the
  proposal launched, a verify of 1 + `block_size` rows per lane fed from the proposal on
  the device, everything read at once. What it costs beyond that verify alone is what
  drafting costs a round once the host builds the verify while the device drafts.

Writes NAME.json and NAME.md (`--name`, default drafting) under --out, each with its
command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter


def timed(build, repeats: int) -> float:
    """Median seconds of evaluating `build()`'s arrays, after one warm-up."""
    mx.eval(build())
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(build())
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run(args) -> dict:
    record = provenance()
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=max(args.lanes))
    target = loaded.target
    drafter = load_drafter(args.drafter, target.model, target.config, dtype=args.dtype, max_lanes=max(args.lanes))
    g = drafter.width
    rng = np.random.default_rng(0)
    result = {**record, "model": args.model, "drafter": args.drafter, "dtype": args.dtype or "as stored",
              "context": args.context, "proposals": g, "repeats": args.repeats, "lanes": {}}
    for lanes in args.lanes:
        r = result["lanes"][lanes] = measure(target, drafter, lanes, args.context, args.repeats, rng)
        print(f"lanes {lanes}: plain {r['plain_step_ms']:.2f} ms, drafting round {r['drafting_round_ms']:.2f} ms "
              f"({r['drafting_over_plain']:.0%}), verify " + " ".join(f"{w}:{ms:.1f}" for w, ms in r["verify_ms"].items())
              + f", drafted round {r['drafted_round_ms']:.2f} ms", flush=True)
    return result


def measure(target, drafter, lanes: int, context: int, repeats: int, rng) -> dict:
    """The three costs for `lanes` lanes that have read random prompts of `context` tokens."""
    g = drafter.width
    slots = [target.open_lane() for _ in range(lanes)]
    drafter_slots = [drafter.open_lane() for _ in range(lanes)]
    prompts = [[int(t) for t in rng.integers(20, 4000, context)] for _ in range(lanes)]
    for slot, dslot, prompt in zip(slots, drafter_slots, prompts):
        _, taps = target.prefill(slot, prompt, chunk=512, taps=drafter.tap_layers)
        drafter.append([dslot], [taps], [prompt])
    mx.eval(drafter.state_arrays())
    anchors = [p[-1] for p in prompts]
    one_row = mx.zeros((1, taps.shape[1]), dtype=taps.dtype)

    def verify(width):
        def build():
            out = target.forward(slots, [[a] * width for a in anchors], taps=drafter.tap_layers)
            return [out.logits.argmax(axis=-1), out.taps, *target.state_arrays()]
        return build

    def drafting_round():
        # A committed row per lane joins the context (uncounted afterwards: lengths are
        # restored below), then the batched proposal.
        drafter.append(drafter_slots, [one_row] * lanes, [[0]] * lanes)
        proposal = drafter.propose(drafter_slots, anchors, g)
        for d in drafter_slots:
            d.length -= 1
        return [*proposal.arrays(), *drafter.state_arrays()]

    def drafted_round():
        drafter.append(drafter_slots, [one_row] * lanes, [[0]] * lanes)
        proposal = drafter.propose(drafter_slots, anchors, g, chain_logits=False)
        mx.async_eval([*proposal.arrays(), *drafter.state_arrays()])  # the device drafts while the verify is built
        fed = mx.concatenate([mx.array(anchors, dtype=mx.int32)[:, None], proposal.tokens.astype(mx.int32)], axis=1)
        out = target.forward(slots, fed.reshape(-1), widths=[g + 1] * lanes, taps=drafter.tap_layers)
        for d in drafter_slots:
            d.length -= 1
        return [out.logits.argmax(axis=-1), out.taps, *proposal.arrays(), *target.state_arrays(), *drafter.state_arrays()]

    plain = timed(verify(1), repeats)  # a plain step: one row per lane
    draft = timed(drafting_round, repeats)
    widths = {w: timed(verify(w), repeats) for w in range(1, g + 2)}
    drafted = timed(drafted_round, repeats)
    for slot in slots:
        target.close_lane(slot)
    for slot in drafter_slots:
        drafter.close_lane(slot)
    return {
        "plain_step_ms": plain * 1e3,
        "drafting_round_ms": draft * 1e3,
        "drafting_over_plain": draft / plain,
        "verify_ms": {w: s * 1e3 for w, s in widths.items()},
        "verify_over_one_row": {w: s / widths[1] for w, s in widths.items()},
        "drafted_round_ms": drafted * 1e3,
        "drafting_in_round_over_plain": (drafted - widths[g + 1]) / plain,
    }


def markdown(result: dict) -> str:
    g = result["proposals"]
    lines = [
        markdown_line(result),
        "",
        (f"Context {result['context']} tokens; {g} proposals per drafting round; dtype {result['dtype']}; "
        f"medians of {result['repeats']} runs after a warm-up."),
        "",
        "| lanes | plain step ms | drafting round ms | drafting / plain |",
        "|---:|---:|---:|---:|",
    ]
    for lanes, r in result["lanes"].items():
        lines.append(f"| {lanes} | {r['plain_step_ms']:.2f} | {r['drafting_round_ms']:.2f} | {r['drafting_over_plain']:.0%} |")
    widths = list(next(iter(result["lanes"].values()))["verify_ms"])
    lines += ["", "Verify forward of w rows per lane, ms (ratio to w = 1):", "",
              "| lanes | " + " | ".join(f"w={w}" for w in widths) + " |", "|---:|" + "---:|" * len(widths)]
    for lanes, r in result["lanes"].items():
        cells = [f"{r['verify_ms'][w]:.2f} ({r['verify_over_one_row'][w]:.2f}x)" for w in widths]
        lines.append(f"| {lanes} | " + " | ".join(cells) + " |")
    lines += ["", f"A drafted round with one host sync (append, proposal, verify of {g + 1} rows fed on the device):", "",
              "| lanes | drafted round ms | beyond the verify alone, / plain step |", "|---:|---:|---:|"]
    for lanes, r in result["lanes"].items():
        lines.append(f"| {lanes} | {r['drafted_round_ms']:.2f} | {r['drafting_in_round_over_plain']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="drafting", help="base name of the result files")
    p.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    args = p.parse_args()
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

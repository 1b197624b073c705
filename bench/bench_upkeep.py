"""What drafting-capable lanes cost in plain rounds, against this machine's own noise.

    python -m bench.bench_upkeep --model DIR --drafter DIR --out DIR
        [--context 32768] [--gen-tokens 160] [--alternations 4] [--decisive 0.03125]

One lane, one prompt of `--context` tokens. A plain engine (no drafter) alternates with
an engine whose lanes hold drafter slots but whose guard never drafts, so every round is
plain and only the upkeep differs: the taps each round keeps and the drafter context
folded in every 64 rows. Two comparisons, each a median of the per-alternation ratios of
decode time (capable / plain):

- `upkeep`: the capable engine as it serves;
- `control`: the same engine with its lanes' drafter slots hidden during rounds (no taps,
  no folds), which is plain work on both sides: its spread is the machine's noise.

The target is made decisive as in bench_engine (see there). Writes upkeep.json and
upkeep.md under --out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.bench_engine import make_decisive, read_prompts
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from lanes.bands import Band
from lanes.engine import Engine, EngineConfig
from lanes.guard import GuardDecision
from lanes.lane import Request
from lanes.round import RoundRunner


class NeverDraft:
    def decide(self, lanes: int, context_tokens: int) -> GuardDecision:
        return GuardDecision(False, False, Band.of(lanes, context_tokens), None, None, "never (bench)")

    def record(self, decision, round_seconds, emitted_tokens) -> None:
        pass


class HiddenDrafter(RoundRunner):
    """Rounds run as if no lane had a drafter slot (prefill still feeds the drafter)."""

    def _dispatch(self, lanes, anchors, ahead=None):
        with _hidden(lanes):
            return super()._dispatch(lanes, anchors, ahead)

    def _land(self, dispatch):
        with _hidden(dispatch.lanes):
            return super()._land(dispatch)


class _hidden:
    def __init__(self, lanes):
        self.lanes = lanes

    def __enter__(self):
        self.slots = [lane.drafter_slot for lane in self.lanes]
        for lane in self.lanes:
            lane.drafter_slot = None

    def __exit__(self, *exc):
        for lane, slot in zip(self.lanes, self.slots):
            lane.drafter_slot = slot


def decode_seconds(engine: Engine, prompt: list[int], gen: int) -> float:
    read_prompts(engine, [Request(prompt, gen)])
    started = time.perf_counter()
    engine.run_until_idle()
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--gen-tokens", type=int, default=160)
    p.add_argument("--alternations", type=int, default=4)
    p.add_argument("--decisive", type=float, default=1 / 32)
    args = p.parse_args()
    record = provenance()

    loaded = open_target(args.model, max_lanes=1)
    target = loaded.target
    make_decisive(target.model, args.decisive)
    drafter = load_drafter(args.drafter, target.model, target.config, max_lanes=1)
    plain = Engine(target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=1))
    plain.warm_up()
    prompt = [5 + (7 * j) % 3000 for j in range(args.context)]
    result = {**record, "model": args.model, "drafter": args.drafter, "context": args.context, "gen_tokens": args.gen_tokens,
              "alternations": args.alternations, "decisive": args.decisive, "comparisons": {}}
    for name, runner in (("upkeep", RoundRunner), ("control", HiddenDrafter)):
        capable = Engine(target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=1),
                         rounds=runner(target, drafter, guard=NeverDraft()))
        capable.warm_up()
        decode_seconds(plain, prompt, args.gen_tokens)
        decode_seconds(capable, prompt, args.gen_tokens)
        ratios = []
        for _ in range(args.alternations):
            base = decode_seconds(plain, prompt, args.gen_tokens)
            ratios.append(decode_seconds(capable, prompt, args.gen_tokens) / base)
        result["comparisons"][name] = {"ratios": ratios, "median": statistics.median(ratios)}
        print(f"{name}: capable / plain decode time {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}", flush=True)

    lines = [markdown_line(result), "",
             f"One lane, context {args.context}, {args.gen_tokens} tokens per run, {args.alternations} alternations.", "",
             "| comparison | capable / plain decode time, per alternation | median |", "|---|---|---:|"]
    for name, r in result["comparisons"].items():
        lines.append(f"| {name} | {', '.join(f'{x:.3f}' for x in r['ratios'])} | {r['median']:.3f} |")
    write_result(args.out, "upkeep", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The draft guard on the embedded default's real acceptance, under round costs given
rather than measured: what the guard makes of a machine whose rounds cost what you say.

    python -m bench.guard_replay --out bench/results/NAME [--plain-ms 1.5] [--drafted-ms 3.3,4.9,8] [--max-tokens 96]
        [--max-probe-share 0.25] [--smoothing 0.1] [--budget 0.02]

The held-out prompts of bench/default_prompts.json run greedy, one stream, float32, on
this machine; every round the guard records is charged `--plain-ms` if it ran plain and
`--drafted-ms` if it drafted, whatever it took here, and verify windows are priced as if
a verify cost the same at any depth (as on a GPU, where rounds are bound by launches).
For each drafted-round cost it reports the speedup those costs give over plain decoding
(tokens x plain cost / the rounds' costs) for: the guard with priced windows (the
drafter's proposal priced ahead by counted survival, as on CUDA), the same with prompt
lookup beside the drafter (what `generate` runs), and fixed width 9 (every round
drafted), with how many rounds each drafted. So a policy is judged on real acceptance
without the noise of real clocks: one machine's run reads as any other's.

Writes NAME.json and NAME.md (`--name`, default guard-replay) under --out, each with its
command, commit and machine.
"""

from __future__ import annotations

import argparse
import json

from bench.bench_default import PROMPTS, encode
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.drafter import load_drafter
from lanes.engine import Engine, EngineConfig
from lanes.guard import DraftGuard
from lanes.lane import Request
from lanes.pricing import CostTable


class ChargedGuard(DraftGuard):
    """The guard, charged the given cost for each round it records."""

    def __init__(self, plain_seconds: float, drafted_seconds: float, max_probe_share: float, smoothing: float, budget: float):
        super().__init__(budget=budget, max_probe_share=max_probe_share, smoothing=smoothing)
        self.costs = {False: plain_seconds, True: drafted_seconds}
        self.charged, self.tokens = 0.0, 0
        self.rounds = {False: 0, True: 0}

    def record(self, decision, round_seconds, emitted_tokens) -> None:
        seconds = self.costs[decision.draft]
        self.charged += seconds
        self.tokens += emitted_tokens
        self.rounds[decision.draft] += 1
        super().record(decision, seconds, emitted_tokens)


class FlatVerifyCosts(CostTable):
    """A verify costs the same at any depth; this machine's clocks teach it nothing."""

    def observe(self, rows: int, lanes: int, context_tokens: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int, lanes: int, context_tokens: int) -> float:
        return 1.0

    def plain_estimate(self, lanes: int, context_tokens: int) -> float:
        return 1.0


def replay(loaded, drafter, prompts: list[list[int]], max_tokens: int, plain_s: float, drafted_s: float,
           max_probe_share: float, smoothing: float, budget: float) -> dict:
    """Speedup over plain and rounds drafted, per policy, under the given costs. Counted
    over the rounds after a reply's first token (which the prompt's read gives)."""
    result = {}
    for name, lookup in (("guard", 0), ("guard_lookup", 2)):
        engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter,
                        EngineConfig(max_streams=1, prompt_lookup=lookup, price_live=False))
        guard = engine.rounds.guard = ChargedGuard(plain_s, drafted_s, max_probe_share, smoothing, budget)
        engine.rounds.costs = FlatVerifyCosts()
        for prompt in prompts:
            engine.generate([Request(prompt, max_tokens)])
        result[name] = {"speedup": guard.tokens * plain_s / guard.charged, "drafted_rounds": guard.rounds[True],
                        "plain_rounds": guard.rounds[False]}
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter,
                    EngineConfig(max_streams=1, draft_width=drafter.width + 1))
    tokens, charged, drafted_rounds = 0, 0.0, 0
    for prompt in prompts:
        (done,) = engine.generate([Request(prompt, max_tokens)])
        rounds = len(done.draft.accepted_per_round)
        from_drafted = sum(done.draft.accepted_per_round) + rounds
        tokens += len(done.token_ids) - 1
        drafted_rounds += rounds
        charged += rounds * drafted_s + (len(done.token_ids) - 1 - from_drafted) * plain_s
    result["fixed"] = {"speedup": tokens * plain_s / charged, "drafted_rounds": drafted_rounds, "plain_rounds": None}
    return result


def run(args) -> dict:
    record = provenance()
    loaded = open_target(default_target_dir(), dtype="float32", max_lanes=1)
    drafter = load_drafter(default_drafter_dir(), loaded.target.model, loaded.target.config, dtype="float32", max_lanes=1)
    prompts = [encode(loaded.tokenizer, p) for p in json.loads(PROMPTS.read_text())["prompts"]]
    result = {**record, "prompts": len(prompts), "max_tokens": args.max_tokens, "plain_ms": args.plain_ms,
              "max_probe_share": args.max_probe_share, "smoothing": args.smoothing, "budget": args.budget, "costs": {}}
    for drafted_ms in args.drafted_ms:
        cell = result["costs"][drafted_ms] = replay(loaded, drafter, prompts, args.max_tokens, args.plain_ms / 1e3,
                                                    drafted_ms / 1e3, args.max_probe_share, args.smoothing, args.budget)
        print(f"drafted {drafted_ms} ms: " + ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in cell.items()), flush=True)
    return result


def markdown(result: dict) -> str:
    setting = (f"{result['prompts']} held-out prompts, greedy, up to {result['max_tokens']} tokens, one stream, float32; "
               f"plain rounds charged {result['plain_ms']} ms, drafted rounds as below, verifies priced flat; "
               f"the guard's probe share at most {result['max_probe_share']}, smoothing {result.get('smoothing', 0.1)}, "
               f"probe budget {result['budget']}. "
               "Speedup over plain under those costs (drafted rounds of the policy).")
    lines = [markdown_line(result), "", setting, "",
             "| drafted round ms | guard, priced | guard, priced, prompt lookup beside it | fixed width 9 |",
             "|---:|---:|---:|---:|"]
    for drafted_ms, cell in result["costs"].items():
        lines.append(f"| {drafted_ms} | " + " | ".join(f"{cell[k]['speedup']:.2f}x ({cell[k]['drafted_rounds']})"
                                                   for k in ("guard", "guard_lookup", "fixed")) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="guard-replay")
    p.add_argument("--plain-ms", type=float, default=1.5)
    p.add_argument("--drafted-ms", type=lambda s: [float(x) for x in s.split(",")], default=[3.3, 4.9, 8.0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-probe-share", type=float, default=DraftGuard().max_probe_share,
                   help="the guard's cap on probes (1 lifts it, as before e14970f)")
    p.add_argument("--smoothing", type=float, default=DraftGuard().smoothing,
                   help="the guard's per-round decay of old evidence (its memory is about 1/smoothing rounds)")
    p.add_argument("--budget", type=float, default=DraftGuard().budget,
                   help="the share of a band's seconds that probes of drafting may lose")
    args = p.parse_args()
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

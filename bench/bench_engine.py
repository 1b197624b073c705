"""Aggregate decode throughput of the lane core with drafting vs without, side by side.

    python -m bench.bench_engine --model DIR --drafter DIR --out bench/results/NAME
        [--streams 1,4,8,16] [--prompt-tokens 256] [--gen-tokens 128] [--alternations 3]
        [--long-contexts 4096,16384,65536] [--long-gen-tokens 64] [--long-alternations 1]
        [--long-prompt-cache] [--long-turn-tokens N] [--in-step-beside] [--log FILE]

Random-weight checkpoints have real costs but no real acceptance, so the drafter is
wrapped in the scripted-acceptance drafter (bench/scripted.py, measurement only): it
runs the real drafter forward for its cost, then proposes the target's own greedy
continuation (recorded by the first plain run of the same prompts) with a survival
profile. Part 1 uses LiquidAI's published acceptance (about 4.8 tokens per round at
verify width 10); part 2 a profile that falls with context (0.55 accepted/proposed at
4K down to 0.07 at 128K), where the guards must stop drafting.

A random target's top two logits are near ties, so on a GPU, where a verify forward of
several rows per lane rounds differently from a one-row step, its greedy choice flips
within a few tokens and the scripted drafter, which proposes the recorded continuation,
loses its track. So by default the target is made decisive, as trained models are: every
layer's output projection is scaled by `--decisive` (1/32), the residual stream keeps the
input token's direction and the tied head picks it with a wide margin. Shapes and costs
are unchanged; `--decisive 1` keeps the weights as drawn.

For each stream count: N distinct prompts; plain and drafted runs alternate
`--alternations` times; each run's decode phase (from the moment every lane has read
its prompt until all finish) gives aggregate tokens per second; the ratio reported is
the median over alternations of a drafted run's to the plain run's before it; beside it,
the same up to each drafted run's first lane end, and the share of the run after it (the
tail, where lanes that drifted apart finish one by one in rounds of fewer lanes). Drafted
windows are priced and the guards decide each round, as in serving. Every drafted run's
tokens are checked against the plain run's. Writes NAME.json and NAME.md (`--name`, default
engine) under --out,
each with its command, commit and machine; `--log` writes every round and every guard decision (the lane core's debug log) to FILE.

At long contexts a run's decode is a second or so and its prompt's read many more, while
a shared GPU's speed drifts by up to 25% from run to run: a ratio within 3% needs many
alternations. `--long-prompt-cache` gives both long-context engines a prefix cache, so
each prompt is read once per engine and every later run restores it (untimed, as every
read is) and goes straight to the decode that is timed. Both engines then also keep the
conv states a cache needs at every block boundary (one copy each 64 tokens), alike.
`--in-step-beside` times a third engine in the same turns: drafting with overlapped rounds
off (`EngineConfig.overlap`; where the device runs behind the host, drafted rounds
overlap by default), each drafted round read before the next is built. Its rows give its
ratio to plain and the overlapped engine's gain over it, each the median over
alternations of runs next to each other.

`--long-turn-tokens N` compares the long-context engines in time rather than in runs:
both read the prompts, then decode them at once, in turns of N tokens a lane (each turn
ended with the device idle, the order swapped every pair), so drift slower than a turn
(about a second at N = 128) falls on both alike. The ratio is of tokens per second over
all turns of `--long-alternations` passes; each pair of turns gives one for the spread.
The target and drafter then hold lane slots for both engines. Each engine times its
rounds on a clock that stops outside its turns (`TurnClock`), so the guard and the cost
table see what they would without the other engine; the rows also give its plain
rounds' upkeep: what the drafting engine's plain rounds took per token beyond the plain
engine's, in the same turns.

Each long-context row also gives drafting's cost in the guarded engine's own time:
what its drafted rounds (the guard's probes among them) took beyond its own plain
rounds' time per token for as many tokens, over all its runs (`drafting_cost`), a
measure the machine's drift between runs does not move.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from bench.lane_log import write_lane_core_log
from bench.provenance import markdown_line, median_range, provenance, spread, write_result
from bench.scripted import (
    ScriptedDrafter,
    falling_with_context_profile,
    published_profile,
)
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.prefix_cache import default_budget_bytes


def read_prompts(engine: Engine, requests: list[Request]) -> None:
    """Submit requests and step the engine until every prompt is read, then wait for the
    device: what follows is decoding alone."""
    for request in requests:
        engine.submit(request)
    engine.step()  # takes the submitted requests in; before it they are neither waiting nor prefilling
    while engine.waiting or engine.prefilling:
        engine.step()
    mx.synchronize()


def decode_run(engine: Engine, prompts: list[list[int]], gen: int, decoding=contextlib.nullcontext) -> dict:
    """Run prompts to completion; time the phase where every lane decodes (run inside
    `decoding()`, a context manager: a profiler that should see decoding alone)."""
    decoded = {"tokens": 0, "timing": False}
    finished = {}

    def count(event):
        if decoded["timing"]:
            decoded["tokens"] += len(event.token_ids)
        if event.completion is not None:
            finished[event.request_id] = event.completion

    requests = [Request(p, gen, on_event=count) for p in prompts]
    read_prompts(engine, requests)
    decoded["timing"] = True
    first_end = None  # the time and the tokens as the step in which a lane first ended was done
    with decoding():
        started = time.perf_counter()
        while engine.step():
            if first_end is None and finished:
                first_end = (time.perf_counter(), decoded["tokens"])
        seconds = time.perf_counter() - started
    done = [finished[r.id] for r in requests]
    drafted = [n for d in done for n in d.draft.accepted_per_round]
    ended_at, full_tokens = first_end or (started + seconds, decoded["tokens"])
    return {
        "tokens": [d.token_ids for d in done],
        "decode_tokens": decoded["tokens"],
        "seconds": seconds,
        "tok_s": decoded["tokens"] / seconds,
        # The tail: from the first lane's end to the last's, fewer lanes share each round.
        # Plain lanes of one length end in the same round; drafted ones drift apart.
        "full_tok_s": full_tokens / max(ended_at - started, 1e-9),
        "tail_seconds_share": 1 - (ended_at - started) / seconds,
        "tail_tokens_share": 1 - full_tokens / max(decoded["tokens"], 1),
        "drafted_rounds": sum(d.draft.drafted_rounds for d in done),
        "rounds": sum(d.draft.rounds for d in done),
        "mean_accepted": statistics.mean(drafted) if drafted else 0.0,
    }


def drafting_cost(before: dict, after: dict) -> float | None:
    """What an engine's drafted rounds lost (positive) or gained (negative) against its own
    plain rounds between two `RoundCounters` snapshots, as a share of all its round time:
    their seconds less what its plain rounds took for as many tokens. Both kinds of round
    ran in the same runs, so the machine's drift between runs cancels. None without
    plain rounds to compare with."""
    seconds, tokens = ({mode: grown(before, after, key, mode) for mode in ("plain", "drafted")}
                       for key in ("seconds_by_mode", "emitted_by_mode"))
    if not tokens["plain"]:
        return None
    lost = seconds["drafted"] - tokens["drafted"] * seconds["plain"] / tokens["plain"]
    return lost / (seconds["plain"] + seconds["drafted"])


def grown(before: dict, after: dict, key: str, mode: str) -> float:
    """How much a `RoundCounters` figure (`key`, by mode) grew between two snapshots."""
    return after[key].get(mode, 0) - before[key].get(mode, 0)


def plain_round_upkeep(plain: tuple[dict, dict], drafting: tuple[dict, dict]) -> float | None:
    """What the drafting engine's plain rounds took per token beyond the plain engine's,
    as a share of the plain engine's, from (before, after) snapshots over the same turns:
    the upkeep drafting costs where it does not draft (taps, the drafter's context), in
    situ. None where either engine ran no plain round."""
    def per_token(counts):
        tokens = grown(*counts, "emitted_by_mode", "plain")
        return grown(*counts, "seconds_by_mode", "plain") / tokens if tokens else None

    theirs, ours = per_token(plain), per_token(drafting)
    return None if theirs is None or ours is None else ours / theirs - 1


def compare(plain: Engine, drafted_engine: Engine, prompts, gen: int, alternations: int, in_step: Engine | None = None) -> dict:
    """Plain and drafted runs in turns (and, given `in_step`, that engine's after each)."""
    plain_runs, drafted_runs, in_step_runs = [], [], []
    counted = drafted_engine.rounds.counters.snapshot()
    for _ in range(alternations):
        plain_runs.append(decode_run(plain, prompts, gen))
        drafted_runs.append(decode_run(drafted_engine, prompts, gen))
        if in_step is not None:
            in_step_runs.append(decode_run(in_step, prompts, gen))
    cost = drafting_cost(counted, drafted_engine.rounds.counters.snapshot())
    exact = all(d["tokens"] == plain_runs[0]["tokens"] for d in drafted_runs + in_step_runs)
    plain_tps = statistics.median(r["tok_s"] for r in plain_runs)
    drafted_tps = statistics.median(r["tok_s"] for r in drafted_runs)
    last = drafted_runs[-1]
    # Each drafted run against the plain run just before it: on a shared machine whose
    # speed drifts, neighbours in time compare better than medians taken apart.
    ratios = [d["tok_s"] / p["tok_s"] for p, d in zip(plain_runs, drafted_runs)]
    beside = {}
    if in_step_runs:
        beside = {
            "in_step_tok_s": statistics.median(r["tok_s"] for r in in_step_runs),
            "in_step_ratios": [s["tok_s"] / p["tok_s"] for p, s in zip(plain_runs, in_step_runs)],
            "overlap_gains": [d["tok_s"] / s["tok_s"] for d, s in zip(drafted_runs, in_step_runs)],
        }
        beside["in_step_ratio"] = statistics.median(beside["in_step_ratios"])
        beside["overlap_gain"] = statistics.median(beside["overlap_gains"])
    return {
        "plain_tok_s": plain_tps,
        "drafted_tok_s": drafted_tps,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "exact": exact,
        "drafted_round_share": last["drafted_rounds"] / max(last["rounds"], 1),
        "mean_accepted_per_drafted_round": last["mean_accepted"],
        "plain_runs_tok_s": [r["tok_s"] for r in plain_runs],
        "drafted_runs_tok_s": [r["tok_s"] for r in drafted_runs],
        "drafting_cost": cost,
        # Drafted runs before their first lane ends, against the plain run before each.
        "full_ratio": statistics.median(d["full_tok_s"] / p["tok_s"] for p, d in zip(plain_runs, drafted_runs)),
        "drafted_tail_seconds_share": statistics.median(d["tail_seconds_share"] for d in drafted_runs),
        "drafted_tail_tokens_share": statistics.median(d["tail_tokens_share"] for d in drafted_runs),
        **beside,
    }


TURN_COUNTS = ("rounds_by_mode", "seconds_by_mode", "emitted_by_mode")


class TurnClock:
    """`time.perf_counter` with the time outside an engine's own turns cut out. A round
    in flight as a turn ends lands in the engine's next turn; timed by the wall, it would
    count the other engine's whole turn, and the guard would see that kind of round as
    slow as a turn (the plain one, mostly: it pipelines)."""

    def __init__(self, wall=time.perf_counter) -> None:
        self._wall = wall
        self._paused_at: float | None = None
        self._skipped = 0.0

    def __call__(self) -> float:
        return (self._wall() if self._paused_at is None else self._paused_at) - self._skipped

    def pause(self) -> None:
        self._paused_at = self._wall()

    def resume(self) -> None:
        self._skipped += self._wall() - self._paused_at
        self._paused_at = None


@contextlib.contextmanager
def own_turn(clock: TurnClock):
    clock.resume()
    try:
        yield
    finally:
        clock.pause()


def in_turns(plain: Engine, drafted_engine: Engine, prompts, gen: int, turn_tokens: int, passes: int) -> dict:
    """Plain and drafted engines decode the same prompts at once, taking turns of
    `turn_tokens` tokens a lane (the order swapped every pair), each turn ending with the
    device idle so that no engine's work runs in the other's time, over `passes` passes.
    Each engine's rounds are timed on a `TurnClock` that stops outside its turns. The
    ratio is of their tokens per second over all turns; each pair of turns, about a
    second apart, gives a ratio too."""
    engines = {"plain": plain, "drafted": drafted_engine}
    clocks = {name: TurnClock() for name in engines}
    wall_clocks = {name: engine.rounds.clock for name, engine in engines.items()}
    for name, engine in engines.items():
        clocks[name].pause()
        # Fresh, it reads as the wall clock does, so no landing the runner timed lies ahead of it.
        engine.rounds.clock = clocks[name]
    try:
        return timed_in_turns(engines, clocks, prompts, gen, turn_tokens, passes)
    finally:
        for name, engine in engines.items():
            engine.rounds.clock = wall_clocks[name]


def timed_in_turns(engines: dict[str, Engine], clocks: dict[str, TurnClock], prompts, gen: int, turn_tokens: int,
                   passes: int) -> dict:
    """`in_turns`, its engines' rounds timed on their `clocks`."""
    turns = {name: [] for name in engines}  # (tokens, seconds) per turn
    pairs = []  # drafted over plain tok/s of each pair of turns in a pass
    # What each engine's round counters grew by within its turns (its prompt reads, and
    # the first round each runs with them, fall outside).
    within = {name: {key: Counter() for key in TURN_COUNTS} for name in engines}
    outputs, exact = None, True
    for _ in range(passes):
        emitted = dict.fromkeys(engines, 0)
        done = {name: {} for name in engines}

        def counter(name):
            def count(event):
                emitted[name] += len(event.token_ids)
                if event.completion is not None:
                    done[name][event.request_id] = event.completion
            return count

        requests = {name: [Request(p, gen, on_event=counter(name)) for p in prompts] for name in engines}
        for name, engine in engines.items():
            with own_turn(clocks[name]):
                read_prompts(engine, requests[name])
        busy, order = dict.fromkeys(engines, True), list(engines)
        taken = {name: len(turns[name]) for name in engines}
        while any(busy.values()):
            for name in order:
                if not busy[name]:
                    continue
                before, counted, started = emitted[name], engines[name].rounds.counters.snapshot(), time.perf_counter()
                with own_turn(clocks[name]):
                    while emitted[name] - before < turn_tokens * len(prompts):
                        if not engines[name].step():
                            busy[name] = False
                            break
                    mx.synchronize()
                turns[name].append((emitted[name] - before, time.perf_counter() - started))
                now = engines[name].rounds.counters.snapshot()
                for key in TURN_COUNTS:
                    within[name][key].update({mode: now[key][mode] - counted[key].get(mode, 0) for mode in now[key]})
            order.reverse()
        pairs += [(d / ds) / (p / ps) for (p, ps), (d, ds) in zip(turns["plain"][taken["plain"]:], turns["drafted"][taken["drafted"]:])
                  if p and d]
        tokens = {name: [done[name][r.id].token_ids for r in requests[name]] for name in engines}
        outputs = outputs or tokens["plain"]
        exact = exact and tokens["plain"] == outputs and tokens["drafted"] == outputs
    counts = {name: (dict.fromkeys(TURN_COUNTS, {}), within[name]) for name in engines}
    rate = lambda name: sum(t for t, _ in turns[name]) / sum(s for _, s in turns[name])
    drafted_rounds = grown(*counts["drafted"], "rounds_by_mode", "drafted")
    rounds = drafted_rounds + grown(*counts["drafted"], "rounds_by_mode", "plain")
    return {
        "plain_tok_s": rate("plain"),
        "drafted_tok_s": rate("drafted"),
        "ratio": rate("drafted") / rate("plain"),
        "ratios": pairs,
        "exact": exact,
        "drafted_round_share": drafted_rounds / max(rounds, 1),
        "turns": turns,
        "drafting_cost": drafting_cost(*counts["drafted"]),
        "plain_round_upkeep": plain_round_upkeep(counts["plain"], counts["drafted"]),
        # About 1: the rounds' seconds are the turns' (a round timed across turns would count more).
        "rounds_over_turns": {name: sum(within[name]["seconds_by_mode"].values()) / sum(s for _, s in turns[name])
                              for name in engines},
    }


def run(args) -> dict:
    result = {**provenance(), "model": args.model, "drafter": args.drafter, "dtype": args.dtype or "as stored",
              "decisive": args.decisive, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "alternations": args.alternations, "long_gen_tokens": args.long_gen_tokens,
              "long_alternations": args.long_alternations, "long_prompt_cache": args.long_prompt_cache,
              "long_turn_tokens": args.long_turn_tokens,
              "in_step_beside": args.in_step_beside,
              "streams": {}, "long_context": {}}
    rng = np.random.default_rng(0)
    if args.streams:
        streams = Setup(args, max(args.streams))
        prompts = {n: streams.prompts(rng, n, args.prompt_tokens) for n in args.streams}
        recorded = {n: decode_run(streams.plain, ps, args.gen_tokens)["tokens"] for n, ps in prompts.items()}
        sequences = [p + t for n in args.streams for p, t in zip(prompts[n], recorded[n])]
        drafted = streams.scripted(published_profile(), sequences)
        in_step = streams.scripted(published_profile(), sequences, overlap=False) if args.in_step_beside else None
        for n in args.streams:
            r = compare(streams.plain, drafted, prompts[n], args.gen_tokens, args.alternations, in_step)
            result["streams"][n] = r
            print(f"streams {n}: plain {r['plain_tok_s']:.1f} tok/s, drafted {r['drafted_tok_s']:.1f} tok/s, "
                  f"ratio {r['ratio']:.2f}, exact {r['exact']}, drafted rounds {r['drafted_round_share']:.0%}"
                  + (f", in step {r['in_step_ratio']:.2f}, overlap gain {r['overlap_gain']:.2f}" if in_step else ""), flush=True)
        del streams, drafted, in_step

    if args.long_contexts:
        # Its own target with few lane slots: the KV pools hold every slot at the longest context.
        long = Setup(args, args.long_streams, prompt_cache=args.long_prompt_cache,
                     slots=2 * args.long_streams if args.long_turn_tokens else None)
        prompts = {c: long.prompts(rng, args.long_streams, c) for c in args.long_contexts}
        recorded = {c: decode_run(long.plain, ps, args.long_gen_tokens)["tokens"] for c, ps in prompts.items()}
        falling = long.scripted(falling_with_context_profile(), [p + t for c in args.long_contexts for p, t in zip(prompts[c], recorded[c])])
        for c in args.long_contexts:
            if args.long_turn_tokens:
                r = in_turns(long.plain, falling, prompts[c], args.long_gen_tokens, args.long_turn_tokens, args.long_alternations)
            else:
                r = compare(long.plain, falling, prompts[c], args.long_gen_tokens, args.long_alternations)
            result["long_context"][c] = r
            print(f"context {c}: plain {r['plain_tok_s']:.1f} tok/s, guarded drafting {r['drafted_tok_s']:.1f} tok/s, "
                  f"ratio {r['ratio']:.3f}, exact {r['exact']}, drafted rounds {r['drafted_round_share']:.0%}", flush=True)
    return result


def make_decisive(model, scale: float) -> None:
    """Scale every layer's output projections (attention, conv, feed-forward) by `scale`."""
    if scale == 1.0:
        return
    for layer in model.layers:
        mixer = layer.self_attn if layer.is_attention else layer.conv
        outputs = [mixer.out_proj]
        ffn = layer.feed_forward
        outputs.append(ffn.experts.w2 if hasattr(ffn, "experts") else ffn.w2)
        for linear in outputs:
            if "scales" in linear:
                raise SystemExit("--decisive needs an unquantized target; pass --decisive 1")
            linear.weight = linear.weight * scale
    mx.eval(model.parameters())


class Setup:
    """A target, its real drafter, and a plain engine over them, each engine of `lanes` lanes."""

    def __init__(self, args, lanes: int, prompt_cache: bool = False, slots: int | None = None):
        """`prompt_cache`: each engine keeps the prompts it read (a prefix cache of a
        quarter of the memory left), so a prompt run again is restored, not read.
        `slots`: the lanes the target and drafter hold (default `lanes`): more, for
        engines whose lanes decode at once."""
        self.lanes = lanes
        self.loaded = open_target(args.model, dtype=args.dtype, max_lanes=slots or lanes)
        target = self.loaded.target
        make_decisive(target.model, args.decisive)
        self.real = load_drafter(args.drafter, target.model, target.config, dtype=args.dtype, max_lanes=slots or lanes)
        self.prompt_cache = prompt_cache
        self.plain = Engine(target, self.loaded.tokenizer, self.loaded.eos_ids, None, self.config())
        self.plain.warm_up()

    def config(self, overlap: bool | None = None) -> EngineConfig:
        return EngineConfig(max_streams=self.lanes, prefix_cache_bytes=default_budget_bytes() if self.prompt_cache else 0,
                            overlap=overlap)

    def prompts(self, rng, count: int, length: int) -> list[list[int]]:
        high = min(self.loaded.target.vocab_size, 4000)
        return [[int(t) for t in rng.integers(20, high, length)] for _ in range(count)]

    def scripted(self, profile, sequences, overlap: bool | None = None) -> Engine:
        target = self.loaded.target
        drafter = ScriptedDrafter(self.real, sequences, profile, target.vocab_size)
        engine = Engine(target, self.loaded.tokenizer, self.loaded.eos_ids, drafter, self.config(overlap))
        engine.warm_up()
        return engine


def markdown(result: dict) -> str:
    lines = [
        markdown_line(result),
        (f"- dtype {result['dtype']}, target made decisive by {result['decisive']:g}; tok/s are medians of alternated runs, "
        "drafted / plain the median of each drafted run's ratio to the plain run just before it"),
    ]
    if result["streams"]:
        lines += ["", (f"Scripted acceptance at the published profile; prompts of {result['prompt_tokens']} tokens, "
                  f"{result['gen_tokens']} generated per stream, {result['alternations']} alternations:"), "",
                  "| streams | plain tok/s | drafted tok/s | drafted / plain | exact | drafted rounds | accepted per drafted round "
                  "| drafted / plain until a lane ends | drafted runs' tail: time [tokens] |"
                  + (" in step tok/s | in step / plain | overlapped / in step [min-max] |" if result.get("in_step_beside") else ""),
                  "|---:|---:|---:|---:|:---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if result.get("in_step_beside") else "")]
    for n, r in result["streams"].items():
        beside = (f" {r['in_step_tok_s']:.1f} | {r['in_step_ratio']:.2f}x | "
                  f"{median_range(spread(r['overlap_gains']), unit='x')} |" if "in_step_tok_s" in r else "")
        lines.append(f"| {n} | {r['plain_tok_s']:.1f} | {r['drafted_tok_s']:.1f} | {r['ratio']:.2f}x | {r['exact']} | "
                     f"{r['drafted_round_share']:.0%} | {r['mean_accepted_per_drafted_round']:.2f} | {r['full_ratio']:.2f}x | "
                     f"{r['drafted_tail_seconds_share']:.0%} [{r['drafted_tail_tokens_share']:.0%}] |{beside}")
    if result["streams"]:
        lines += ["", ("Until a lane ends: each drafted run's tokens per second up to its first lane's end, against "
                       "the plain run before it. The tail: the share of a drafted run's time (and tokens) after that, "
                       "while fewer lanes share each round; plain lanes of one length end in the same round.")]
    if result["long_context"]:
        turns = result.get("long_turn_tokens")
        how = (f"the two engines decoding at once in turns of {turns} tokens a lane, {result['long_alternations']} passes "
               "(ratio: of tok/s over all turns, [min-max] of the pairs of turns)" if turns
               else f"{result['long_alternations']} alternations")
        lines += ["", ("Acceptance falling with context (0.55 accepted/proposed at 4K to 0.07 at 128K), guards on, "
                  f"{result['long_gen_tokens']} generated per run, {how}"
                  f"{', prompts restored from a prefix cache after their first read' if result['long_prompt_cache'] else ''}:"), "",
                  "| context | plain tok/s | guarded drafting tok/s | ratio [min-max] | drafted rounds | drafting's cost in its own time |"
                  + (" its plain rounds' upkeep |" if turns else ""),
                  "|---:|---:|---:|---:|---:|---:|" + ("---:|" if turns else "")]
        share = lambda x: "-" if x is None else f"{x:+.1%}"
        for c, r in result["long_context"].items():
            within = f" {share(r['plain_round_upkeep'])} |" if turns else ""
            lines.append(f"| {c} | {r['plain_tok_s']:.1f} | {r['drafted_tok_s']:.1f} | {r['ratio']:.2f}x "
                         f"[{min(r['ratios']):.2f}-{max(r['ratios']):.2f}] | {r['drafted_round_share']:.0%} | "
                         f"{share(r.get('drafting_cost'))} |{within}")
        lines += ["", ("Drafting's cost in its own time: what the guarded engine's drafted rounds (probes included) "
                       "took beyond what its own plain rounds took per token for as many tokens, as a share of all its "
                       "round time over the alternations (negative: a gain). Both kinds of round ran in the same runs, "
                       "so it does not move with the machine's speed between runs as the ratio does; it leaves out "
                       "the upkeep inside plain rounds (`bench_upkeep`)."
                       + (" Its plain rounds' upkeep: what the drafting engine's plain rounds took per token beyond "
                          "the plain engine's, in the same turns." if turns else ""))]
    return "\n".join(lines) + "\n"


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="engine", help="base name of the result files")
    p.add_argument("--streams", type=ints, default=[1, 4, 8, 16], help="stream counts ('' skips part 1)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--alternations", type=int, default=3)
    p.add_argument("--long-contexts", type=ints, default=[])
    p.add_argument("--long-streams", type=int, default=1)
    p.add_argument("--long-gen-tokens", type=int, default=64)
    p.add_argument("--long-alternations", type=int, default=1)
    p.add_argument("--long-turn-tokens", type=int, default=0,
                   help="long contexts: the two engines decode at once in turns of this many tokens a lane (0: whole runs alternate)")
    p.add_argument("--long-prompt-cache", action="store_true",
                   help="keep each long prompt in a prefix cache per engine: read once, restored for every later run")
    p.add_argument("--in-step-beside", action="store_true",
                   help="also time drafting with overlapped rounds off, in the same turns (see above)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--decisive", type=float, default=1 / 32,
                   help="scale of the target's output projections (1 keeps the drawn weights; see above)")
    p.add_argument("--log", help="write the lane core's debug log (rounds, guard decisions) here")
    args = p.parse_args()
    if args.log:
        write_lane_core_log(args.log)
    result = run(args)
    for r in [*result["streams"].values(), *result["long_context"].values()]:
        r.pop("tokens", None)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

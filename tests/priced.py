"""Priced drafting without timing, and floors on how much a test drafted.

With real clocks the guards draft only where drafting measures faster, and the pricing
admits drafts only where measured costs say they pay, so whether a run drafts at all
depends on the machine. These doubles keep the priced path (calibration, chain chances,
the prefix scheduler, verification) while making its inputs fixed: the guard always
drafts, and every round costs the same whatever its rows, so every draft is priced in.

A test that finds drafted output equal to plain output proves nothing if no draft was
verified; `assert_drafted` makes it fail when drafting silently stops. `tiny_engine`
builds the engines the tests drive, priced this way unless asked otherwise.
"""

from __future__ import annotations

from bench.scripted import AlwaysDraft, ScriptedDrafter, published_profile
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from lanes.bands import Band
from lanes.engine import Engine, EngineConfig
from lanes.guard import GuardDecision
from lanes.pricing import CostTable


class EveryThirdPlain(AlwaysDraft):
    """A guard that drafts two rounds and keeps the third plain, over and over."""

    def __init__(self):
        self.decided = 0

    def decide(self, lanes: int, context_tokens: int) -> GuardDecision:
        self.decided += 1
        return GuardDecision(self.decided % 3 != 0, False, Band.of(lanes, context_tokens), None, None, "every third plain (test)")


class FlatCosts(CostTable):
    """Every round costs one second whatever its rows. Live rounds teach it nothing: the
    table a round observes into would otherwise turn this machine's timings into verify
    depths."""

    def observe(self, rows: int, lanes: int, context_tokens: int, seconds: float) -> None:
        pass

    def estimate(self, rows: int, lanes: int, context_tokens: int) -> float:
        return 1.0

    def plain_estimate(self, lanes: int, context_tokens: int) -> float:
        return 1.0


def price_without_timing(engine) -> None:
    engine.rounds.guard = AlwaysDraft()
    engine.rounds.costs = FlatCosts()


def tiny_engine(path, drafter_dir=None, lanes: int = 16, sequences=None, bits: int | None = None, timing: str | None = "flat",
                **config) -> Engine:
    """An Engine over the checkpoint at `path` (EngineConfig fields in `config`), drafting
    with `drafter_dir`'s drafter when given, its drafts accepted at the published profile
    over `sequences` (the plain runs' tokens) when given. Without a fixed draft_width its
    rounds are priced: `timing` "flat" without timing (see above), "warm" from the
    warm-up's profile and live clocks as a server prices them, None left to the caller."""
    loaded = open_target(path, max_lanes=lanes)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, bits=bits, max_lanes=lanes)
        if sequences is not None:
            drafter = ScriptedDrafter(drafter, sequences, published_profile(), loaded.target.vocab_size)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=lanes, **config))
    if drafter is not None and config.get("draft_width") is None:
        if timing == "flat":
            price_without_timing(engine)
        elif timing == "warm":
            engine.warm_up()
    return engine


def assert_drafted(completions, rounds: int, accepted: int) -> None:
    """At least `rounds` drafted lane-rounds and `accepted` kept drafts over `completions`."""
    drafted = sum(c.draft.drafted_rounds for c in completions)
    kept = sum(c.draft.accepted for c in completions)
    assert drafted >= rounds and kept >= accepted, (
        f"{drafted} drafted rounds (floor {rounds}) and {kept} accepted drafts (floor {accepted})")


def fewest_drafted_rounds(outputs, width: int) -> int:
    """Drafted rounds that lanes drafting every round they may must have taken to write
    `outputs` (token lists): a lane's first token comes from its prefill, its last may
    come from a plain step (one token left: nothing to draft), and a round keeps at most
    `width` tokens."""
    return sum(-(-(len(tokens) - 2) // width) for tokens in outputs if len(tokens) > 2)

"""Priced drafting without timing: for tests that must see drafted rounds happen.

With real clocks the guards draft only where drafting measures faster, and the pricing
admits drafts only where measured costs say they pay, so whether a run drafts at all
depends on the machine. These doubles keep the priced path (calibration, chain chances,
the prefix scheduler, verification) while making its inputs fixed: the guard always
drafts, and every round costs the same whatever its rows, so every draft is priced in.
"""

from __future__ import annotations

from lanes.bands import Band
from lanes.guard import GuardDecision
from lanes.pricing import CostTable


class AlwaysDraft:
    def decide(self, lanes: int, context_tokens: int) -> GuardDecision:
        return GuardDecision(True, False, Band.of(lanes, context_tokens), None, None, "always (test)")

    def record(self, decision, round_seconds, emitted_tokens) -> None:
        pass

    def snapshot(self) -> dict:
        return {}


def flat_costs(max_rows: int = 1024) -> CostTable:
    costs = CostTable()
    for rows in (1, max_rows):
        costs.seed(rows, 1, 0, 1.0)
    return costs


def price_without_timing(engine) -> None:
    engine.rounds.guard = AlwaysDraft()
    engine.rounds.costs = flat_costs()

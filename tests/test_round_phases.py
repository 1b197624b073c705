"""A drafted round's time by phase: the lane core logs each phase's seconds, which add up
to the round's, and bench.round_phases reads them back per kind and lane count."""

from __future__ import annotations

import logging

import pytest

from bench.round_phases import rounds, summary
from lanes.lane import Request
from lanes.round import DRAFTED_PHASES
from tests.priced import tiny_engine


def test_drafted_rounds_log_their_phases_and_the_reader_sums_them(dense_dir, drafter_dir, caplog):
    engine = tiny_engine(dense_dir, drafter_dir, lanes=2, draft_width=5)
    with caplog.at_level(logging.DEBUG, logger="laneserve.round"):
        engine.generate([Request(list(range(20, 40)), 12), Request(list(range(50, 61)), 9)])
    found = rounds(caplog.messages)
    drafted = [r for r in found if r["kind"] == "drafted"]
    assert drafted and all(r["kind"] in ("plain", "drafted") for r in found)
    for r in drafted:
        phases = [r[f"{name}_seconds"] for name in DRAFTED_PHASES]
        assert min(phases) >= 0 and sum(phases) == pytest.approx(r["seconds"], abs=1e-5)  # logged to the microsecond
        assert r["draft_seconds"] >= 0
    groups = {(g["kind"], g["lanes"]): g for g in summary(found)}
    two = groups["drafted", 2]
    assert set(two["phases_ms"]) == set(DRAFTED_PHASES)
    assert two["rounds"] == sum(1 for r in drafted if r["lanes"] == 2)
    assert two["ms_per_token"] == pytest.approx(
        1e3 * sum(r["seconds"] for r in drafted if r["lanes"] == 2) / sum(r["emitted"] for r in drafted if r["lanes"] == 2))


def test_logs_from_before_the_phases_give_the_draft_alone():
    line = ("5515 laneserve.round round kind=drafted lanes=1 rows=10 emitted=5 seconds=0.013000 draft_seconds=0.003900 "
            "drafting_lanes=1 context=300")
    [group] = summary(rounds([line, "5516 laneserve.guard something else"]))
    assert group["phases_ms"] == {"draft": pytest.approx(3.9)} and group["ms_per_token"] == pytest.approx(2.6)

"""A drafted round's time by phase: the lane core logs each phase's seconds, which add up
to the round's, and bench.round_phases reads them back per kind and lane count."""

from __future__ import annotations

import logging

import pytest

from bench.round_phases import drafted_by_width, rounds, summary, tails
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


def test_a_stamped_log_gives_each_round_its_interval_and_the_share_rounds_cover():
    def line(at: str, kind: str, seconds: float) -> str:
        return (f"2026-12-05 16:28:{at} laneserve.round DEBUG round kind={kind} lanes=16 rows=160 emitted=80 "
                f"seconds={seconds:.6f} draft_seconds=0.000000 drafting_lanes=16 context=100")

    log = [line("10,000", "drafted", 0.008), line("10,010", "drafted", 0.008), "2026-12-05 16:28:10,011 laneserve.access x",
           line("10,030", "drafted", 0.010), line("15,000", "drafted", 0.008),  # after an idle engine: no interval
           line("15,004", "plain", 0.004)]
    found = rounds(log)
    assert "interval" not in found[0] and [r["interval"] for r in found[1:3]] == [pytest.approx(0.010), pytest.approx(0.020)]
    groups = {g["kind"]: g for g in summary(found)}
    assert groups["drafted"]["median_interval_ms"] == pytest.approx(15.0)
    assert groups["drafted"]["in_rounds"] == pytest.approx(0.018 / 0.030)
    assert groups["plain"]["in_rounds"] == pytest.approx(1.0)
    assert [r["seconds"] for r in rounds(log, ("16:28:11", "16:28:20"))] == [0.008, 0.004]
    unstamped = [entry[len("2026-12-05 16:28:10,000 "):] for entry in log[:2]]  # as bench_engine's --log wrote them before 4fe8f30
    assert "in_rounds" not in summary(rounds(unstamped))[0]


def test_a_bench_engine_log_splits_each_drafting_run_into_its_full_rounds_and_its_tail():
    def line(ms: int, kind: str, lanes: int, emitted: int, seconds: float) -> str:
        return (f"2026-12-07 09:25:10,{ms:03d} laneserve.round DEBUG round kind={kind} lanes={lanes} rows={lanes} "
                f"emitted={emitted} seconds={seconds:.6f} draft_seconds=0.000000 drafting_lanes={lanes} context=300")

    log = [line(0, "plain", 4, 4, 0.002), line(2, "plain", 4, 4, 0.002),  # the plain engine's run: no tail
           line(10, "drafted", 4, 16, 0.008), line(20, "drafted", 4, 18, 0.009), line(30, "probe", 4, 4, 0.004),
           line(45, "drafted", 3, 9, 0.012), line(60, "plain", 2, 2, 0.003),  # lanes ended: the tail
           line(62, "plain", 4, 4, 0.002),  # the plain engine again
           line(70, "drafted", 4, 20, 0.008)]  # a run cut short: no tail yet, not counted
    [run] = tails(rounds(log), 4)
    assert run["full_tokens"] == 16 + 18 + 4 and run["tail_tokens"] == 9 + 2
    assert run["full_seconds"] == pytest.approx(0.008 + 0.010 + 0.010)  # the first round's own seconds, then intervals
    assert run["tail_seconds"] == pytest.approx(0.015 + 0.015)
    assert run["tail_rounds"] == {"drafted": 1, "probe": 0, "plain": 1}


def test_drafted_rounds_of_the_runs_after_the_warm_up_are_told_apart_by_part_width_and_first_of_shape():
    def line(ms: int, kind: str, lanes: int, rows: int, seconds: float, first: bool = False) -> str:
        return (f"2026-12-07 09:25:10,{ms:03d} laneserve.round DEBUG round kind={kind} lanes={lanes} rows={rows} "
                f"emitted={lanes} seconds={seconds:.6f} draft_seconds=0.000000 drafting_lanes={lanes} context=300"
                + (" first_of_shape=1" if first else ""))

    warm_up = [line(0, "drafted", 4, 40, 0.5, True), line(10, "drafted", 2, 20, 0.4, True), line(20, "plain", 4, 4, 0.002)]
    run = [line(30, "drafted", 4, 32, 0.008), line(40, "drafted", 4, 32, 0.010), line(50, "drafted", 4, 40, 0.012),
           line(60, "drafted", 3, 24, 0.016, True), line(70, "drafted", 3, 24, 0.014), line(80, "plain", 2, 2, 0.003),
           line(90, "plain", 4, 4, 0.002)]
    table = drafted_by_width(rounds(warm_up + run), 4)
    assert [(w["part"], w["rows_per_lane"], w["first_of_shape"], w["rounds"]) for w in table] == [
        ("full", 8, False, 2), ("full", 10, False, 1), ("tail", 8, False, 1), ("tail", 8, True, 1)]
    assert table[0]["median_ms"] == pytest.approx(9.0) and table[3]["median_ms"] == pytest.approx(16.0)

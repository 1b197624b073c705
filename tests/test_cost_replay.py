"""bench.cost_replay: a round log's rounds fed to a fresh cost table as the round runner
feeds it (rounds of a shape met for the first time, or behind an unseen prompt chunk,
left out), with the table's estimates read before each drafted round of one lane count."""

from __future__ import annotations

import pytest

from bench.cost_replay import read_log, replay
from bench.round_phases import rounds


def line(kind: str, lanes: int, rows: int, seconds: float, extra: str = "") -> str:
    return (f"2026-12-07 15:20:00,000 laneserve.round DEBUG round kind={kind} lanes={lanes} rows={rows} emitted={lanes} "
            f"seconds={seconds:.6f} draft_seconds=0.001000 drafting_lanes={lanes} context=200{extra}")


def test_a_round_log_is_replayed_as_the_runner_feeds_the_table():
    log = [line("drafted", 15, 150, 0.500, " first_of_shape=1"),  # never evidence
           line("drafted", 10, 100, 0.036),  # one round, high
           *[line("drafted", 15, 150, 0.0207) for _ in range(10)],
           *[line("drafted", 15, 60, 0.0173) for _ in range(10)],
           line("drafted", 15, 150, 0.900, " behind_prompt=1")]  # never evidence
    result = replay(rounds(log), 15, [60, 150])
    assert result["verified"][150]["rounds"] == 11  # the first found the table empty
    assert result["verified"][60]["rounds"] == 10
    (band,) = result["bands"]
    assert {rows: cell["rounds"] for rows, cell in band["by_rows"].items()} == {60: 10, 100: 1, 150: 10}
    assert [band["by_rows"][rows]["ms"] for rows in (60, 100, 150)] == pytest.approx([16.3, 35.0, 19.7])
    # Before the rounds of 60 rows, 150 rows were priced near their own figure, the one round of 100 pooled in.
    assert result["verified"][60]["estimates_ms"][150] == pytest.approx((35.0 + 10 * 19.7) / 11)


def test_a_servers_warm_up_rounds_are_left_out(tmp_path):
    # They taught a throwaway table (lanes/warmup.py); the log says when serving began.
    log = tmp_path / "head.log"
    log.write_text("\n".join([line("drafted", 15, 150, 2.0), "2026-12-07 15:20:00,000 laneserve INFO serving on http://127.0.0.1:8301",
                               line("drafted", 15, 150, 0.0207)]) + "\n")
    assert [r["seconds"] for r in read_log(str(log), "serving on")] == [0.0207]
    assert [r["seconds"] for r in read_log(str(log), "")] == [2.0, 0.0207]
    assert [r["seconds"] for r in read_log(str(log), "never logged")] == [2.0, 0.0207]

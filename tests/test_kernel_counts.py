"""bench.kernel_counts' attribution of a marked run's kernels to round phases (the
profiling itself needs CUDA and torch)."""

from __future__ import annotations

from bench.kernel_counts import AFTER_LAST_MARK, by_phase, phases_table

SITES = {"_drafted_round:410": 0, "_drafted_round:413": 1}


def mark(index: int) -> str:
    return f"mlx::core::cu::custom_kernel_laneserve_phase_mark_{index}_a1b2"


def test_kernels_belong_to_the_phase_that_ends_at_the_next_mark():
    events = [  # (device start, name, us), given out of order
        (5.0, "gemv", 3.0), (1.0, "arange", 2.0), (2.0, mark(0), 1.0), (3.0, "gemv", 4.0), (4.0, "rope", 1.5),
        (6.0, mark(1), 1.0), (7.0, "arange", 9.0), (8.0, mark(0), 1.0), (9.0, "scatter", 2.5),
    ]
    phases = by_phase(events, SITES)
    first, second = phases["_drafted_round:410"], phases["_drafted_round:413"]
    assert first["marks"] == 2 and first["kernels"] == 2 and first["by_name"] == {"arange": [2, 11.0]}
    assert second["marks"] == 1 and second["kernels"] == 3 and second["by_name"] == {"gemv": [2, 7.0], "rope": [1, 1.5]}
    assert phases[AFTER_LAST_MARK]["by_name"] == {"scatter": [1, 2.5]} and phases[AFTER_LAST_MARK]["marks"] == 0
    assert second["device_us"] == 8.5


def test_a_mark_numbered_ten_is_not_mark_one():
    sites = {f"f:{i}": i for i in range(11)}
    phases = by_phase([(1.0, "gemv", 1.0), (2.0, mark(10), 1.0)], sites)
    assert list(phases) == ["f:10"]


def test_table_reports_per_round():
    text = phases_table(by_phase([(1.0, "gemv", 4.0), (2.0, "gemv", 4.0), (3.0, mark(1), 1.0)], SITES), rounds=2)
    assert "_drafted_round:413: marks 1, kernels per round 1.0, device us per round 4.0" in text
    assert "1.0 a round      4.0 us  gemv" in text

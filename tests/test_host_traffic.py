"""bench.host_traffic's iterations and report (its profiling needs CUDA and torch)."""

from __future__ import annotations

from bench.host_traffic import CAPACITY, HEADS, REGIMES, WIDTH, Iterations, markdown, summary


def expected_ids(offsets: list[int]) -> list[int]:
    """Row ids of lane i, head h, row w: (i * HEADS + h) * CAPACITY + offsets[i] + w."""
    return [(i * HEADS + h) * CAPACITY + o + w for i, o in enumerate(offsets) for h in range(HEADS) for w in range(WIDTH)]


def test_every_regime_gathers_the_rows_of_its_offsets():
    iterations = Iterations(3)
    for regime in REGIMES:
        offsets = iterations.offsets(regime)
        taken = iterations.step
        assert iterations.ids(offsets).tolist() == expected_ids(offsets.tolist()), regime
        if regime in ("host input", "host input and read"):
            assert offsets.tolist() == [s + taken for s in iterations.start]
        if regime == "cached host input":
            assert offsets.tolist() == iterations.start


def test_only_the_reading_regimes_return_the_ids():
    iterations = Iterations(2)
    for regime in REGIMES:
        before = iterations.device_offsets.tolist()
        read = iterations.run(regime)
        if regime.endswith("read"):
            assert len(read) == 2 * HEADS * WIDTH
            if regime == "host read":  # offsets advanced on the device by one
                assert read == expected_ids([(o + 1) % (CAPACITY - WIDTH) for o in before])
        else:
            assert read is None


def test_report_has_a_row_per_regime_and_kernel():
    turn = lambda us: {"kernels": 7.0, "device_us": us, "wall_us": 3 * us, "calls": {"cudaMallocManaged": 0.5},
                       "kernel_us": {"void mlx::core::cu::arange<int, int, 4>(int*, int, int, int)": us / 7}}
    result = {"command": "c", "commit": "abc", "machine": "m", "mlx": "0.32.4", "date": "d", "lanes": 16,
              "iterations": 10, "turns": 2, "regimes": {r: summary([turn(14.0), turn(70.0)]) for r in REGIMES}}
    text = markdown(result)
    assert all(f"| {r} | 7.0 | 42.0 [14.0-70.0] |" in text for r in REGIMES)
    assert "| `mlx::core::cu::arange<int, int, 4>` | 6.0 |" in text
    assert "cudaMallocManaged 0.50" in text

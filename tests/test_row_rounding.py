"""bench.row_rounding: the first row of a verify window against the same row alone."""

from __future__ import annotations

import argparse

from bench.row_rounding import markdown, run


def test_each_width_counts_the_prompts_whose_first_row_differs(dense_dir, drafter_dir):
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype="float32", widths=[2, 5])
    result = run(args)
    assert result["prompts"] > 0 and sorted(result["widths"]) == [2, 5]
    for found in result["widths"].values():
        assert 0 <= found["argmax_differs"] <= found["differ"] <= result["prompts"]
        assert (found["max_abs_diff"] > 0) == (found["differ"] > 0)
    assert "| 5 |" in markdown(result)

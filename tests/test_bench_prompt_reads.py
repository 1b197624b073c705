"""bench_prompt_reads times its systems in turns and leaves the target as it found it."""

from __future__ import annotations

import argparse

import families.lfm2.model as lfm2_model
from bench import bench_prompt_reads
from families.lfm2 import Lfm2Target


def test_three_systems_in_turns_with_ratios_to_steady(dense_dir, monkeypatch):
    widths_asked = []
    original = Lfm2Target.steady_width

    def counting(self, widths, bounds):
        widths_asked.append(list(widths))
        return original(self, widths, bounds)

    monkeypatch.setattr(Lfm2Target, "steady_width", counting)
    monkeypatch.setattr(Lfm2Target, "plans_per_shape", staticmethod(lambda: True))  # pad as on CUDA
    args = argparse.Namespace(model=str(dense_dir), dtype="float32", length=9, count=2, lanes=3, long=40,
                              alternations=3, seed=0)
    result = bench_prompt_reads.run(args)
    assert set(result["systems"]) == {"steady", "every_shape", "ragged_rows"}
    assert set(result["over_steady"]) == {"every_shape", "ragged_rows"}
    for name, cells in result["systems"].items():
        assert len(cells["short_ms"]["turns"]) == len(cells["long_s"]["turns"]) == 3, name
    # Steady systems ask for a width at every read (3 lanes, each a new length), ragged_rows never:
    # the first-call read, then 2 systems x 3 turns x (2 short reads + 1 long).
    assert len(widths_asked) == 1 + 2 * 3 * 3 and all(len(w) in (1, 3) for w in widths_asked)
    # Short prompts keep near --length, each length new until all from 9 to 17 have come.
    short = [w for w in widths_asked if len(w) == 3]
    assert all(9 <= n < 18 for w in short for n in w) and len({n for w in short[:3] for n in w}) == 9
    assert result["short_prompts"] == 3 * (1 + 3 * 3 * 2) and result["short_lengths"] == 9
    assert lfm2_model.STEADY_QUERY == bench_prompt_reads.SYSTEMS["steady"][0]
    assert "| ragged_rows / steady |" in bench_prompt_reads.markdown(result)

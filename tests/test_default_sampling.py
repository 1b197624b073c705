"""The loop scores that chose the default's sampling settings (bench/default_sampling.py)."""

from __future__ import annotations

import argparse

from bench import default_sampling as ds


def test_a_loop_repeats_its_four_grams_and_fresh_text_does_not():
    loop = [1, 2, 3] * 10  # "a b c a b c ..."
    fresh = list(range(30))
    assert ds.rep4(fresh) == 0.0 and not ds.looping(fresh) and ds.distinct2(fresh) == 1.0
    assert ds.rep4(loop) == (27 - 3) / 27 and ds.looping(loop) and ds.distinct2(loop) == 3 / 29
    once = list(range(10)) + [0, 1, 2, 3] * 3  # a 4-gram seen 4 times loops; 3 times does not
    assert ds.looping(once) and not ds.looping(list(range(10)) + [0, 1, 2, 3] * 2)
    assert ds.rep4([5, 5, 5]) == 0.0 and not ds.looping([])


def test_greedy_settings_ignore_the_filters():
    args = argparse.Namespace(temperatures=[0.0, 0.5], penalties=[1.0, 1.2], min_p=[0.05, 0.1], top_p=[1.0])
    settings = ds.grid(args)
    greedy = [s for s in settings if s.temperature == 0]
    assert [(s.repetition_penalty, s.min_p) for s in greedy] == [(1.0, 0.0), (1.2, 0.0)]
    assert len(settings) - len(greedy) == 4

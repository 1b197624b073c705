"""bench_engine's long-context runs with `--long-prompt-cache`: a prompt is read once per
engine and restored for every later run, whose decode equals the first's."""

from __future__ import annotations

import argparse

import numpy as np

from bench.bench_engine import Setup, compare, decode_run
from bench.scripted import falling_with_context_profile, published_profile


def test_long_prompts_are_read_once_per_engine_then_restored(dense_dir, drafter_dir):
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32)
    setup = Setup(args, 1, prompt_cache=True)
    prompts = setup.prompts(np.random.default_rng(0), 1, 300)
    recorded = decode_run(setup.plain, prompts, 12)["tokens"]
    drafted = setup.scripted(falling_with_context_profile(), [p + t for p, t in zip(prompts, recorded)])
    result = compare(setup.plain, drafted, prompts, 12, 2)
    assert result["exact"]
    for engine, runs in ((setup.plain, 3), (drafted, 2)):
        cache = engine.stats()["prefix_cache"]
        # Every run after an engine's first restores all of the prompt's whole blocks.
        assert cache["hit_tokens_total"] == (runs - 1) * (300 // cache["block_tokens"]) * cache["block_tokens"]


def test_a_read_first_engine_runs_beside_the_drafted_one(dense_dir, drafter_dir):
    """`--beside-read-first`: the same drafting without proposals launched ahead runs after
    each drafted run, is as exact, and is reported against the same plain runs."""
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32)
    setup = Setup(args, 2)
    prompts = setup.prompts(np.random.default_rng(1), 2, 40)
    recorded = decode_run(setup.plain, prompts, 16)["tokens"]
    sequences = [p + t for p, t in zip(prompts, recorded)]
    drafted = setup.scripted(published_profile(), sequences)
    read_first = setup.scripted(published_profile(), sequences, draft_ahead=False)
    assert drafted.rounds.draft_ahead is (not drafted.rounds.price_live) and not read_first.rounds.draft_ahead
    result = compare(setup.plain, drafted, prompts, 16, 2, beside=read_first)
    assert result["exact"] and result["beside"]["exact"]
    assert len(result["beside"]["ratios"]) == len(result["ratios"]) == 2
    assert result["beside"]["mean_accepted_per_drafted_round"] > 0

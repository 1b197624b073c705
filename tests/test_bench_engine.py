"""bench_engine's long-context runs with `--long-prompt-cache`: a prompt is read once per
engine and restored for every later run, whose decode equals the first's."""

from __future__ import annotations

import argparse

import numpy as np

from bench.bench_engine import Setup, compare, decode_run
from bench.scripted import falling_with_context_profile


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

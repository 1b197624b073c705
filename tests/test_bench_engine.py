"""bench_engine's long-context runs: with `--long-prompt-cache` a prompt is read once per
engine and restored for every later run, whose decode equals the first's; with
`--long-turn-tokens` both engines decode at once, in turns, exactly."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import pytest

from bench.bench_engine import Setup, compare, decode_run, drafting_cost, in_turns
from bench.scripted import falling_with_context_profile
from tests.priced import EveryThirdPlain


def test_long_prompts_are_read_once_per_engine_then_restored(dense_dir, drafter_dir):
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32)
    setup = Setup(args, 1, prompt_cache=True)
    prompts = setup.prompts(np.random.default_rng(0), 1, 300)
    recorded = decode_run(setup.plain, prompts, 12)["tokens"]
    drafted = setup.scripted(falling_with_context_profile(), [p + t for p, t in zip(prompts, recorded)])
    drafted.rounds.guard = EveryThirdPlain()  # plain rounds beside drafted ones whatever the clock says
    result = compare(setup.plain, drafted, prompts, 12, 2)
    assert result["exact"] and result["drafting_cost"] is not None
    for engine, runs in ((setup.plain, 3), (drafted, 2)):
        cache = engine.stats()["prefix_cache"]
        # Every run after an engine's first restores all of the prompt's whole blocks.
        assert cache["hit_tokens_total"] == (runs - 1) * (300 // cache["block_tokens"]) * cache["block_tokens"]


def test_two_engines_in_turns_decode_the_same_prompts_at_once_exactly(dense_dir, drafter_dir):
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32)
    setup = Setup(args, 1, prompt_cache=True, slots=2)  # a lane slot for each engine
    prompts = setup.prompts(np.random.default_rng(2), 1, 300)
    recorded = decode_run(setup.plain, prompts, 40)["tokens"]
    drafted = setup.scripted(falling_with_context_profile(), [p + t for p, t in zip(prompts, recorded)])
    drafted.rounds.guard = EveryThirdPlain()  # plain rounds beside drafted ones, overlapped ones among them
    result = in_turns(setup.plain, drafted, prompts, 40, 8, 2)
    assert result["exact"] and result["drafting_cost"] is not None
    plain, drafted_turns = result["turns"]["plain"], result["turns"]["drafted"]
    # Each pass decodes 39 tokens after the prompt's (whose read also runs the first round:
    # a plain one lands in the first turn, a drafted one up to 10 tokens with the read), in
    # turns of at least 8 tokens.
    assert sum(t for t, _ in plain) == 2 * 39
    assert 2 * (39 - 10) <= sum(t for t, _ in drafted_turns) < 2 * 39
    assert 2 * 3 <= len(drafted_turns) <= len(plain) == 2 * 5
    assert len(result["ratios"]) >= 2 * 3 and result["ratio"] > 0  # a pair for each turn both engines took in a pass


def test_decoding_alone_runs_inside_the_given_context(dense_dir, drafter_dir):
    """What kernel_counts profiles: every prompt read before it, every token after."""
    setup = Setup(argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32), 2)
    seen = []

    @contextlib.contextmanager
    def decoding():
        seen.append(("enter", setup.plain.waiting or setup.plain.prefilling, setup.plain.stats()["generation_tokens_total"]))
        yield
        seen.append(("exit", setup.plain.stats()["generation_tokens_total"]))

    before = setup.plain.stats()["generation_tokens_total"]
    run = decode_run(setup.plain, setup.prompts(np.random.default_rng(1), 2, 40), 9, decoding)
    (_, busy, at_entry), (_, at_exit) = seen
    assert not busy and at_exit - before == 2 * 9 and at_exit - at_entry == run["decode_tokens"]


def test_drafting_cost_is_what_drafted_rounds_took_beyond_plain_rounds_for_as_many_tokens():
    before = {"seconds_by_mode": {"plain": 1.0}, "emitted_by_mode": {"plain": 50}}
    # Plain rounds then take 1.0 s for 100 tokens (10 ms a token); drafted ones 0.5 s for 40
    # tokens, 0.1 s more than plain rounds would: 0.1 of 1.5 s of rounds.
    after = {"seconds_by_mode": {"plain": 2.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 150, "drafted": 40}}
    assert drafting_cost(before, after) == pytest.approx(0.1 / 1.5)
    gained = {"seconds_by_mode": {"plain": 2.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 150, "drafted": 100}}
    assert drafting_cost(before, gained) == pytest.approx((0.5 - 1.0) / 1.5)
    assert drafting_cost(before, {"seconds_by_mode": {"plain": 1.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 50, "drafted": 9}}) is None

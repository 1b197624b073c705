"""bench_engine's long-context runs: with `--long-prompt-cache` a prompt is read once per
engine and restored for every later run, whose decode equals the first's; with
`--long-turn-tokens` both engines decode at once, in turns, exactly."""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import pytest

import bench.bench_engine as bench_engine
from bench.bench_engine import Setup, compare, decode_run, drafting_cost, TurnClock, in_turns, plain_round_upkeep
from bench.scripted import falling_with_context_profile
from lanes.lane import Completion, DraftStats, FinishReason, LaneEvent
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


@pytest.mark.parametrize("clock_stops", [True, False])
def test_two_engines_in_turns_decode_the_same_prompts_at_once_exactly(clock_stops, dense_dir, drafter_dir, monkeypatch):
    if not clock_stops:  # as before e9bff8b: rounds in flight across turns count the other engine's turn
        monkeypatch.setattr(TurnClock, "pause", lambda self: None)
        monkeypatch.setattr(TurnClock, "resume", lambda self: None)
    args = argparse.Namespace(model=str(dense_dir), drafter=str(drafter_dir), dtype=None, decisive=1 / 32)
    setup = Setup(args, 1, prompt_cache=True, slots=2)  # a lane slot for each engine
    prompts = setup.prompts(np.random.default_rng(2), 1, 300)
    recorded = decode_run(setup.plain, prompts, 40)["tokens"]
    drafted = setup.scripted(falling_with_context_profile(), [p + t for p, t in zip(prompts, recorded)])
    drafted.rounds.guard = EveryThirdPlain()  # plain rounds beside drafted ones, overlapped ones among them
    clocks = [setup.plain.rounds.clock, drafted.rounds.clock]
    result = in_turns(setup.plain, drafted, prompts, 40, 8, 2)
    assert [setup.plain.rounds.clock, drafted.rounds.clock] == clocks  # the turns' clocks were theirs alone
    assert result["exact"] and result["drafting_cost"] is not None
    plain, drafted_turns = result["turns"]["plain"], result["turns"]["drafted"]
    # Each pass decodes the 39 tokens after the prompt's in turns of at least 8 tokens (a
    # lane decodes from the step after the one that read its prompt: no round runs in the read).
    assert sum(t for t, _ in plain) == sum(t for t, _ in drafted_turns) == 2 * 39
    assert 2 * 3 <= len(drafted_turns) <= len(plain) == 2 * 5
    assert len(result["ratios"]) >= 2 * 3 and result["ratio"] > 0  # a pair for each turn both engines took in a pass
    assert result["plain_round_upkeep"] is not None
    in_rounds = result["rounds_over_turns"]["plain"]
    assert 0.8 < in_rounds < 1.2 if clock_stops else in_rounds > 1.5, result["rounds_over_turns"]


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


class LanesEndingApart:
    """An engine whose two lanes each take one token per 1 s round, the first ending after
    2 rounds, the second after 6; `decode_run` reads the time from `clock`."""

    waiting = prefilling = 0

    def __init__(self, clock):
        self.clock, self.requests = clock, []

    def submit(self, request):
        self.requests.append(request)

    def step(self):
        """The prompts' read (the first step), then one round a step: whether lanes are left."""
        self.round = getattr(self, "round", -1) + 1
        if self.round == 0:
            return True
        ends = [2, 6]
        self.clock[0] += 1.0
        for request, end in zip(self.requests, ends):
            if self.round <= end:
                done = Completion(request.id, 0, [7] * end, "", FinishReason.LENGTH, DraftStats()) if self.round == end else None
                request.on_event(LaneEvent(request.id, [7], "", completion=done))
        return self.round < max(ends)


def test_a_run_reports_its_tail_from_the_first_lane_end_to_the_last(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_engine.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench_engine.mx, "synchronize", lambda: None)
    run = decode_run(LanesEndingApart(clock), [[1], [2]], 6)
    assert run["tok_s"] == pytest.approx(8 / 6)
    # Until the first lane ended (2 s): 4 tokens; then 4 s more for the other lane's last 4.
    assert run["full_tok_s"] == pytest.approx(2.0)
    assert run["tail_seconds_share"] == pytest.approx(4 / 6) and run["tail_tokens_share"] == pytest.approx(4 / 8)


def test_drafting_cost_is_what_drafted_rounds_took_beyond_plain_rounds_for_as_many_tokens():
    before = {"seconds_by_mode": {"plain": 1.0}, "emitted_by_mode": {"plain": 50}}
    # Plain rounds then take 1.0 s for 100 tokens (10 ms a token); drafted ones 0.5 s for 40
    # tokens, 0.1 s more than plain rounds would: 0.1 of 1.5 s of rounds.
    after = {"seconds_by_mode": {"plain": 2.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 150, "drafted": 40}}
    assert drafting_cost(before, after) == pytest.approx(0.1 / 1.5)
    gained = {"seconds_by_mode": {"plain": 2.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 150, "drafted": 100}}
    assert drafting_cost(before, gained) == pytest.approx((0.5 - 1.0) / 1.5)
    assert drafting_cost(before, {"seconds_by_mode": {"plain": 1.0, "drafted": 0.5}, "emitted_by_mode": {"plain": 50, "drafted": 9}}) is None


def test_plain_round_upkeep_compares_plain_rounds_per_token_over_the_same_turns():
    before = {"seconds_by_mode": {"plain": 1.0}, "emitted_by_mode": {"plain": 100}}
    # The plain engine's rounds then take 1.0 s for 100 tokens; the drafting engine's plain
    # rounds 0.33 s for 30 tokens (11 ms a token, 10% more), its drafted ones not counted.
    plain = (before, {"seconds_by_mode": {"plain": 2.0}, "emitted_by_mode": {"plain": 200}})
    drafting = (before, {"seconds_by_mode": {"plain": 1.33, "drafted": 5.0}, "emitted_by_mode": {"plain": 130, "drafted": 900}})
    assert plain_round_upkeep(plain, drafting) == pytest.approx(0.1)
    only_drafted = (before, {"seconds_by_mode": {"plain": 1.0, "drafted": 5.0}, "emitted_by_mode": {"plain": 100, "drafted": 900}})
    assert plain_round_upkeep(plain, only_drafted) is None


def test_a_turn_clock_stands_still_outside_its_engines_turns():
    """A round in flight as one engine's turn ends lands in its next turn: the other
    engine's turn between must not count as its time."""
    wall = iter([10.0, 11.0, 15.0, 20.0, 22.0, 23.0]).__next__
    clock = TurnClock(wall)
    clock.pause()  # at 10: the other engine's turn
    started = clock()
    clock.resume()  # at 11
    assert clock() - started == pytest.approx(4.0)  # at 15: the second between turns left out
    clock.pause()  # at 20
    assert clock() == pytest.approx(19.0)  # stands still while the other engine runs
    clock.resume()  # at 22
    assert clock() - started == pytest.approx(10.0)  # at 23: 4 + 5 + 1 seconds of its own turns

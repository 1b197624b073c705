"""The prefix cache: a lane resumed from cached blocks emits exactly what a fresh lane
emits, token for token (greedy and seeded, drafted and plain, dense and MoE), a hit
changes no neighbour, eviction keeps outputs exact, and memory stays within the budget."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import open_target
from lanes.lane import Request
from lanes.prefix_cache import PrefixCache, block_digest
from lanes.sampling import SamplingParams
from tests.priced import tiny_engine

BLOCK = 16
BUDGET = 1 << 26
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=1.0, seed=11)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(15, 500, n)]


def engine_for(path, drafter_dir=None, cache=BUDGET, lanes=4, width=4, scripted=None):
    """An engine with drafting at a fixed width (no clock decides whether it drafts). With
    `scripted` (plain runs' sequences), drafts are accepted at the published profile, so
    commits keep several rows and cross block boundaries mid-round."""
    return tiny_engine(path, drafter_dir, lanes, scripted, draft_width=width if drafter_dir is not None else None,
                       prefix_cache_bytes=cache, prefix_block_tokens=BLOCK)


def chat(turns: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a conversation: each turn's prompt is the last one, its reply (filled in
    by `converse`) and a new user message; lengths vary so prefixes end anywhere in a block."""
    return [[1] + tokens(seed, 37)] + [tokens(seed + t, 9 + 7 * t) for t in range(1, turns)]


def converse(engine, messages, sampling=GREEDY, reply=12, **request):
    """Run the turns on `engine`; returns each turn's completion."""
    prompt, done = [], []
    for message in messages:
        prompt = prompt + (done[-1].token_ids if done else []) + message
        done.append(engine.generate([Request(prompt, reply, sampling=sampling, **request)])[0])
    return done


def fresh(path, drafter_dir, prompts, sampling=GREEDY, reply=12):
    engine = engine_for(path, drafter_dir, cache=0)
    return [engine.generate([Request(p, reply, sampling=sampling)])[0].token_ids for p in prompts]


class Finished(dict):
    """An on_event that keeps each request's completion, by id."""

    def __call__(self, event):
        if event.completion is not None:
            self[event.request_id] = event.completion


def prompts_of(messages, done):
    prompt, out = [], []
    for i, message in enumerate(messages):
        prompt = prompt + (done[i - 1].token_ids if i else []) + message
        out.append(prompt)
    return out


@pytest.mark.parametrize("drafting", [False, True])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_each_turn_of_a_chat_resumes_and_equals_a_fresh_lane(drafting, sampling, dense_dir, drafter_dir):
    messages = chat(5)
    engine = engine_for(dense_dir, drafter_dir if drafting else None)
    done = converse(engine, messages, sampling)
    prompts = prompts_of(messages, done)
    assert [d.token_ids for d in done] == fresh(dense_dir, drafter_dir if drafting else None, prompts, sampling)
    # Every later turn resumes from whole blocks of what came before, leaving >= 1 token to read.
    for prompt, before, d in zip(prompts[1:], prompts, done[1:]):
        assert d.cached_tokens == min(len(before) + 11, len(prompt) - 1) // BLOCK * BLOCK > 0
    if drafting:
        assert sum(d.draft.drafted_rounds for d in done) >= 4 * len(done)  # width fixed: every round past the first drafts


@pytest.mark.parametrize("cut", [BLOCK * 3, BLOCK * 3 + 1, BLOCK * 3 + 7, BLOCK * 4 - 1])
def test_prefixes_ending_at_and_inside_a_block_resume_exactly(cut, dense_dir, drafter_dir):
    base = [1] + tokens(7, 80)
    engine = engine_for(dense_dir, drafter_dir)
    engine.generate([Request(base, 4)])
    prompt = base[:cut] + tokens(8, 5)
    resumed = engine.generate([Request(prompt, 16)])[0]
    assert resumed.cached_tokens == cut // BLOCK * BLOCK
    assert resumed.token_ids == fresh(dense_dir, drafter_dir, [prompt], reply=16)[0]


def test_a_prompt_wholly_cached_still_reads_its_last_token(dense_dir):
    prompt = [1] + tokens(9, BLOCK * 4 - 1)  # four whole blocks
    engine = engine_for(dense_dir)
    first = engine.generate([Request(prompt, 8)])[0]
    again = engine.generate([Request(prompt, 8)])[0]
    assert again.cached_tokens == BLOCK * 3 and again.token_ids == first.token_ids


def test_scripted_drafts_crossing_block_boundaries_mid_round_resume_exactly(dense_dir, drafter_dir):
    # Accepted drafts commit up to 5 rows a round, so block boundaries fall inside commits:
    # the conv state recorded there must be the one at the boundary, not at the round's end.
    messages = chat(4, seed=20)
    plain = converse(engine_for(dense_dir, cache=0), messages, reply=24)
    prompts = prompts_of(messages, plain)
    sequences = [p + d.token_ids for p, d in zip(prompts, plain)]
    engine = engine_for(dense_dir, drafter_dir, scripted=sequences, width=5)
    done = converse(engine, messages, reply=24)
    assert [d.token_ids for d in done] == [d.token_ids for d in plain]
    assert sum(d.cached_tokens for d in done) > 0
    assert sum(d.draft.accepted for d in done) >= 20  # many multi-row commits (the profile keeps ~2 per round)


def test_resumed_caches_equal_a_fresh_lanes(dense_dir, drafter_dir):
    # Outputs could agree while the drafter's restored context were wrong (the target
    # verifies every draft), so compare what the lanes hold once their prompt is read.
    base = [1] + tokens(30, 70)
    prompt = base + tokens(31, 20)
    held = []
    for cache in (BUDGET, 0):
        engine = engine_for(dense_dir, drafter_dir, cache=cache, width=3)
        if cache:
            engine.generate([Request(base, 3)])
        engine.submit(Request(prompt, 50, id="probe"))
        while not (engine._running and engine._running[0].generated):  # prefilled: the first token is out
            engine.step()
        lane = engine._running[0]
        engine.rounds.fold_pending([lane])
        n = lane.target_slot.length
        assert lane.drafter_slot.length == n >= len(prompt)
        slot = lane.target_slot.slot
        target_rows = [a for pool in engine.target.kv.values() for a in pool.rows(slot, 0, n)]
        held.append((lane.cached_tokens, *target_rows, *engine.drafter.context_rows(lane.drafter_slot, 0, n),
                     *(pool.state[slot] for pool in engine.target.conv.values())))
    (hit, *resumed), (miss, *fresh_held) = held
    assert hit == 64 and miss == 0
    for a, b in zip(resumed, fresh_held, strict=True):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-5).item()


@pytest.mark.parametrize("drafting", [False, True])
def test_moe_resumes_exactly(drafting, moe_dir, moe_drafter_dir):
    messages = chat(3, seed=40)
    drafter = moe_drafter_dir if drafting else None
    done = converse(engine_for(moe_dir, drafter), messages, SEEDED)
    assert done[-1].cached_tokens > 0
    assert [d.token_ids for d in done] == fresh(moe_dir, drafter, prompts_of(messages, done), SEEDED)


def test_sixteen_lanes_sharing_prefixes_equal_their_solo_runs(dense_dir, drafter_dir):
    system = [1] + tokens(50, 45)
    prompts = [system + tokens(60 + i, 3 + i) for i in range(16)]
    solo = fresh(dense_dir, drafter_dir, prompts, SEEDED, reply=10)
    engine = engine_for(dense_dir, drafter_dir, lanes=16)
    engine.generate([Request(system + [7], 2)])  # the shared system prompt is cached
    done = engine.generate([Request(p, 10, sampling=SEEDED, draft=i % 3 != 0) for i, p in enumerate(prompts)])
    assert [d.token_ids for d in done] == solo
    assert all(d.cached_tokens == 32 for d in done)
    assert engine.prefix_cache.stats()["hit_tokens_total"] == 16 * 32


def test_a_hit_while_neighbours_decode_leaves_them_unchanged(dense_dir, drafter_dir):
    neighbours = [[1] + tokens(70 + i, 20 + 9 * i) for i in range(3)]
    solo = fresh(dense_dir, drafter_dir, neighbours, SEEDED, reply=30)
    base = [1] + tokens(80, 60)
    engine = engine_for(dense_dir, drafter_dir)
    engine.generate([Request(base, 2)])
    done = Finished()
    for i, p in enumerate(neighbours):
        engine.submit(Request(p, 30, sampling=SEEDED, id=f"n{i}", on_event=done))
    for _ in range(6):  # the neighbours are decoding when the hit arrives
        engine.step()
    assert all(lane.generated for lane in engine._running)
    engine.submit(Request(base + tokens(81, 4), 8, id="hit", on_event=done))
    engine.run_until_idle()
    assert done["hit"].cached_tokens == 48
    assert [done[f"n{i}"].token_ids for i in range(3)] == solo


def test_eviction_under_a_tiny_budget_keeps_outputs_exact_and_memory_bounded(dense_dir, drafter_dir):
    probe = engine_for(dense_dir, drafter_dir)
    probe.generate([Request([1] + tokens(90, BLOCK * 2), 2)])
    per_block = probe.prefix_cache.stats()["bytes"] // 2
    budget = 4 * per_block  # four blocks: the conversations evict each other's
    plain = engine_for(dense_dir, drafter_dir, cache=0)
    conversations = []
    for c in range(3):
        messages = chat(4, seed=100 + 10 * c)
        done = converse(plain, messages)
        conversations.append(list(zip(prompts_of(messages, done), [d.token_ids for d in done])))
    engine = engine_for(dense_dir, drafter_dir, cache=budget)
    # Some turns follow their own conversation's last (hits), others another's (misses, evictions).
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 0), (2, 1), (0, 3), (1, 2), (2, 2), (1, 3), (2, 3)]
    for c, turn in order:
        prompt, expected = conversations[c][turn]
        assert engine.generate([Request(prompt, 12)])[0].token_ids == expected
        stats = engine.prefix_cache.stats()
        assert stats["bytes"] <= budget and stats["blocks"] <= 4
    assert stats["hit_tokens_total"] >= 3 * 3 * BLOCK  # at least the three second turns hit


def test_memory_returns_to_the_budget_after_churn_and_nothing_stays_pinned(dense_dir, drafter_dir):
    engine = engine_for(dense_dir, drafter_dir, lanes=8, cache=1 << 16)
    idle = engine.stats()["kv_bytes_in_use"]
    system = [1] + tokens(110, 40)

    def held_outside_the_cache() -> int:
        mx.synchronize()
        return mx.get_active_memory() - engine.stats()["prefix_cache"]["bytes"]

    for wave in range(6):
        if wave == 2:  # what the first waves left (pools at their idle size, traces) is the baseline
            baseline = held_outside_the_cache()
        requests = [Request(system + tokens(120 + 8 * wave + i, 30 + 5 * i), 10, id=f"w{wave}-{i}") for i in range(8)]
        for r in requests:
            engine.submit(r)
        for _ in range(3 + wave):
            engine.step()
        for r in requests[::2]:
            engine.cancel(r.id)  # cancelled lanes offer what they read too
        engine.run_until_idle()
    stats = engine.stats()
    assert stats["prefix_cache"]["bytes"] <= 1 << 16
    assert all(block.pins == 0 for block in engine.prefix_cache._blocks.values())
    assert stats["kv_bytes_in_use"] == idle and stats["prefix_cache"]["hit_tokens_total"] > 0
    assert held_outside_the_cache() <= baseline + (64 << 10)  # nothing but the cache's blocks grows


def test_pinned_blocks_survive_eviction(dense_dir):
    engine = engine_for(dense_dir, lanes=2)
    base = [1] + tokens(130, BLOCK * 3)
    engine.generate([Request(base, 2)])
    cache = engine.prefix_cache
    cache.budget_bytes = cache.stats()["bytes"]  # full: anything new must evict
    engine.submit(Request(base + [5, 6], 40, id="pinning"))
    engine.step()  # admitted: it resumed from (and pins) the three blocks
    pinned = set(cache._blocks)
    engine.generate([Request([1] + tokens(131, BLOCK * 3), 2)])  # offers three blocks; none fit
    assert pinned <= set(cache._blocks)
    engine.run_until_idle()


def test_a_request_may_bypass_the_cache(dense_dir):
    prompt = [1] + tokens(140, 50)
    engine = engine_for(dense_dir)
    engine.generate([Request(prompt, 4)])
    bypass = engine.generate([Request(prompt, 4, cache=False)])[0]
    assert bypass.cached_tokens == 0
    assert engine.generate([Request(prompt, 4)])[0].cached_tokens == 48


def test_a_request_that_bypasses_the_cache_leaves_nothing_in_it(dense_dir):
    prompt = [1] + tokens(141, 50)
    engine = engine_for(dense_dir)
    engine.generate([Request(prompt, 4, cache=False)])
    assert engine.prefix_cache.stats()["blocks"] == 0
    assert engine.generate([Request(prompt, 4)])[0].cached_tokens == 0
    assert engine.prefix_cache.stats()["blocks"] > 0  # the same prompt, cached this time


def test_blocks_are_named_by_their_whole_prefix():
    a, b = list(range(BLOCK)), list(range(1, BLOCK + 1))
    assert block_digest(b"", a) != block_digest(b"", b)
    assert block_digest(block_digest(b"", a), b) != block_digest(block_digest(b"", b), b)


def test_a_bad_budget_is_refused_by_name(dense_dir):
    loaded = open_target(dense_dir, max_lanes=1)
    with pytest.raises(ValueError, match="positive budget"):
        PrefixCache(loaded.target, None, 0)


@pytest.mark.parametrize("drafting", [False, True])
def test_steady_prompt_reads_resume_and_record_blocks_exactly(drafting, dense_dir, drafter_dir):
    # Padded to steady widths (as on CUDA), a resumed turn reads the rest of its prompt past
    # a cached prefix, the padding rows run past block boundaries the lane never keeps:
    # every turn must still equal a fresh lane's, and the blocks it records resume exactly.
    messages = chat(4, seed=3)
    engine = tiny_engine(dense_dir, drafter_dir if drafting else None, 4, None, draft_width=4 if drafting else None,
                         prefix_cache_bytes=BUDGET, prefix_block_tokens=BLOCK, steady_shapes=True)
    done = converse(engine, messages)
    prompts = prompts_of(messages, done)
    assert [d.token_ids for d in done] == fresh(dense_dir, drafter_dir if drafting else None, prompts)
    assert all(d.cached_tokens > 0 for d in done[1:])

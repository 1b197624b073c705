"""Overlapped drafted rounds (lanes/round.py): a round built from the anchors and lengths
of the round before as the device holds them gives exactly the tokens a plain run gives,
and the family's device-length paths equal its host-length ones.

What is tested is that every value the next round needs comes from the device and
is right, not how the rounds overlap in time."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from bench.scripted import ScriptedDrafter, published_profile
from families.lfm2 import attention_kernel, conv_kernel, open_target
from families.lfm2.cache import KVPool
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.acceptance import greedy_accept_length
from lanes.lane import FinishReason, Request
from lanes.protocols import DeviceLengths
from lanes.round import DraftedDispatch, RoundRunner
from lanes.sampling import SamplingParams, noise_key, noise_keys_on_device
from lanes.verify import accepted_on_device
from tests.priced import EveryThirdPlain, FlatCosts, tiny_engine
from tests.test_attention_kernel import emulated_pool_attention
from tests.test_conv_kernel import emulated_gated_conv, emulated_kept_states

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(40 + i).integers(15, 500, 3 + 4 * i)] for i in range(16)]
MAX_TOKENS = 48


def engine_for(path, drafter_dir=None, sequences=None, lanes=16, overlap=True, **config):
    # Priced from counted survival (no live prices), as where shapes are kept steady.
    return tiny_engine(path, drafter_dir, lanes, sequences, overlap=overlap, price_live=False, **config)


@pytest.fixture(scope="module")
def plain(dense_dir):
    return [c.token_ids for c in engine_for(dense_dir).generate([Request(p, MAX_TOKENS) for p in PROMPTS])]


@pytest.fixture
def overlapped(monkeypatch):
    """Counts the overlapped drafted rounds launched (a test that finds outputs equal
    proves nothing if none overlapped)."""
    launched = []
    dispatch = RoundRunner._dispatch_drafted

    def counting(self, lanes, previous):
        launched.append((len(lanes), previous is not None))
        return dispatch(self, lanes, previous)

    monkeypatch.setattr(RoundRunner, "_dispatch_drafted", counting)
    return launched


def sequences_of(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs)]


@pytest.mark.parametrize("width", [None, 2, 5, 10])
@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_overlapped_drafted_rounds_equal_plain(width, lanes, dense_dir, drafter_dir, plain, overlapped):
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes, draft_width=width)
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:lanes]])
    assert [d.token_ids for d in done] == plain[:lanes]
    chained = sum(1 for _, from_device in overlapped if from_device)
    assert chained >= 4, f"{chained} rounds built from the device's anchors and lengths"
    assert sum(d.draft.accepted for d in done) >= 2 * lanes  # partial accepts, at several depths


def test_switching_between_plain_and_overlapped_rounds_stays_exact(dense_dir, drafter_dir, plain, overlapped):
    # Every switch between overlapped drafted rounds and pipelined plain ones, both ways.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=4)
    engine.rounds.guard = EveryThirdPlain()
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    assert sum(1 for _, from_device in overlapped if from_device) >= 4
    assert engine.rounds.counters.snapshot()["rounds_by_mode"]["plain"] >= 4


def test_lanes_without_a_drafter_ride_along_in_overlapped_rounds(dense_dir, drafter_dir, plain, overlapped):
    # A lane whose request turned drafting off feeds its anchor and padding, keeps one
    # token a round, and leaves the drafting lanes overlapping.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=6)
    done = engine.generate([Request(p, MAX_TOKENS, draft=i % 3 != 1) for i, p in enumerate(PROMPTS[:6])])
    assert [d.token_ids for d in done] == plain[:6]
    assert all(d.draft.drafted_rounds == 0 for d in done[1::3])
    assert sum(d.draft.accepted for d in done) >= 8
    assert sum(1 for lanes, from_device in overlapped if from_device and lanes == 6) >= 4


@pytest.mark.parametrize("at", range(3, 15))
def test_a_batch_left_with_riders_only_goes_on_plainly(at, dense_dir, drafter_dir, plain, overlapped):
    # The drafting lane ends at a stop string as the round before lands, leaving a lane
    # that does not draft: no drafted round is built for it (there is nothing to
    # propose), and it finishes as it would alone.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=2)
    engine.rounds.guard = EveryThirdPlain()
    stop = engine.tokenizer.decode(plain[0][at : at + 1])
    requests = lambda: [Request(PROMPTS[0], MAX_TOKENS, stop=(stop,) if stop.strip() else ()),
                        Request(PROMPTS[1], MAX_TOKENS, draft=False)]
    reference = engine_for(dense_dir, lanes=2).generate(requests())
    done = engine.generate(requests())
    assert [(d.token_ids, d.error) for d in done] == [(r.token_ids, None) for r in reference]


def test_unscripted_drafts_rejected_mostly_stay_exact(dense_dir, drafter_dir, plain, overlapped):
    done = engine_for(dense_dir, drafter_dir, None, 8).generate([Request(p, MAX_TOKENS) for p in PROMPTS[:8]])
    assert [d.token_ids for d in done] == plain[:8]
    assert any(from_device for _, from_device in overlapped)


@pytest.fixture
def carried(monkeypatch):
    """(lanes that joined, lanes that left) of every round started from a round in flight
    whose lanes were not its own."""
    churn = []
    state = RoundRunner._carried_state

    def recording(self, lanes, previous):
        if previous.lanes != lanes:
            ids, before = {id(lane) for lane in lanes}, {id(lane) for lane in previous.lanes}
            churn.append((len(ids - before), len(before - ids)))
        return state(self, lanes, previous)

    monkeypatch.setattr(RoundRunner, "_carried_state", recording)
    return churn


def test_lanes_that_end_early_or_join_late_leave_the_rest_exact(dense_dir, drafter_dir, plain, overlapped, carried):
    # Short and long replies: lanes end (max_tokens) while the next round is in flight,
    # and the others go on; more requests than lanes join as slots free. The rounds go on
    # overlapping through both: the next starts from the one in flight, lanes that joined
    # from the host's state beside it.
    limits = [3 + 7 * (i % 5) for i in range(len(PROMPTS))]
    sequences = sequences_of(PROMPTS, plain)
    engine = engine_for(dense_dir, drafter_dir, sequences, lanes=4)
    done = engine.generate([Request(p, n) for p, n in zip(PROMPTS, limits)])
    assert [d.token_ids for d in done] == [out[:n] for out, n in zip(plain, limits)]
    assert any(from_device for _, from_device in overlapped)
    assert any(joined for joined, _ in carried) and any(left for _, left in carried)
    # Lanes that joined a round in flight draft as well as the others (the scripted
    # drafter follows them by their committed tokens): at the published profile most
    # tokens after a reply's first come from kept drafts.
    kept, decoded = sum(d.draft.accepted for d in done), sum(len(d.token_ids) - 1 for d in done)
    assert kept >= 0.5 * decoded, f"{kept} kept drafts of {decoded} decoded tokens"


def test_lanes_ending_one_by_one_leave_the_pools_as_they_are(dense_dir, drafter_dir, overlapped, monkeypatch):
    # Prompts near a KV step (256 positions) and replies of staggered lengths: the lanes
    # end one by one across it, as in a batch's tail. A pool shrunk to the rows left when a
    # lane ended grew back at the next round (its key span rounds up to 256): every end
    # copied every pool twice.
    prompts = [[1] + [int(t) for t in np.random.default_rng(70 + i).integers(15, 500, 235 + i)] for i in range(6)]
    limits = [8 + 6 * i for i in range(6)]
    solo = [c.token_ids for c in engine_for(dense_dir, lanes=1).generate([Request(p, n) for p, n in zip(prompts, limits)])]
    engine = engine_for(dense_dir, drafter_dir, sequences_of(prompts, solo), lanes=6, steady_shapes=True)
    changes = []
    for name in ("reserve", "shrink"):
        method = getattr(KVPool, name)

        def recorded(pool, positions, method=method, name=name):
            before = pool.capacity
            method(pool, positions)
            if pool.capacity != before:
                changes.append((name, id(pool), engine.running))

        monkeypatch.setattr(KVPool, name, recorded)
    assert [d.token_ids for d in engine.generate([Request(p, n) for p, n in zip(prompts, limits)])] == solo
    assert any(from_device for _, from_device in overlapped)
    shrunk_while_open = {pool for name, pool, running in changes if name == "shrink" and running}
    grown_after = [pool for i, (name, pool, _) in enumerate(changes)
                   if name == "reserve" and any(c[0] == "shrink" and c[1] == pool and c[2] for c in changes[:i])]
    assert not grown_after, f"{len(grown_after)} pools grew back after shrinking ({len(shrunk_while_open)} shrunk with lanes open)"


def test_sampled_and_penalised_lanes_join_and_leave_overlapped_rounds_exactly(dense_dir, drafter_dir, carried):
    # What a lane has seen comes from the device for lanes in the round in flight and from
    # the host for lanes that joined, a lane without a penalty beside one with it.
    settings = [dict(repetition_penalty=1.3), dict(), dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2),
                dict(temperature=0.7)]
    prompts = [PROMPTS[i] + [50 + i] for i in range(10)]
    requests = lambda: [Request(p, 6 + 5 * (i % 4), SamplingParams(seed=90 + i, **settings[i % 4])) for i, p in enumerate(prompts)]
    reference = engine_for(dense_dir, lanes=3).generate(requests())
    engine = engine_for(dense_dir, drafter_dir, sequences_of(prompts, [r.token_ids for r in reference]), lanes=3)
    done = engine.generate(requests())
    assert [d.token_ids for d in done] == [r.token_ids for r in reference]
    assert sum(1 for joined, _ in carried if joined) >= 3 and any(left for _, left in carried)


@pytest.mark.parametrize("cancelled", [(0,), (1, 3)])
def test_neighbours_of_a_lane_cancelled_under_an_overlapped_round_equal_their_runs(cancelled, dense_dir, drafter_dir, plain):
    # The round in flight holds the cancelled lane's rows between its neighbours': landing
    # it must skip them and give every other lane its own tokens and lengths.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=4)
    finished = {}
    requests = [Request(p, MAX_TOKENS, on_event=lambda e: e.completion and finished.setdefault(e.request_id, e.completion))
                for p in PROMPTS[:4]]
    for r in requests:
        engine.submit(r)
    inflight = lambda: engine.rounds._inflight
    while not (engine.running == 4 and engine.prefilling == 0 and isinstance(inflight(), DraftedDispatch)
               and all(lane.generated for lane in inflight().lanes) and inflight().lengths.bounds[0] > len(PROMPTS[0])):
        engine.step()
    assert not finished
    for i in cancelled:
        engine.cancel(requests[i].id)
    engine.run_until_idle()
    for i, r in enumerate(requests):
        done = finished[r.id]
        if i in cancelled:
            assert done.finish_reason is FinishReason.CANCELLED and done.token_ids == plain[i][: len(done.token_ids)]
        else:
            assert done.token_ids == plain[i], f"lane {i}, a neighbour of the cancelled {cancelled}"


def test_stop_strings_end_a_lane_exactly(dense_dir, drafter_dir, plain, overlapped):
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=4)
    texts = [engine.tokenizer.decode(out[20:22]) for out in plain[:4]]
    stops = [(t,) if t.strip() else () for t in texts]
    reference = engine_for(dense_dir, lanes=4).generate([Request(p, MAX_TOKENS, stop=s) for p, s in zip(PROMPTS[:4], stops)])
    done = engine.generate([Request(p, MAX_TOKENS, stop=s) for p, s in zip(PROMPTS[:4], stops)])
    assert [(d.token_ids, d.text, d.finish_reason) for d in done] == [(r.token_ids, r.text, r.finish_reason) for r in reference]
    assert any(from_device for _, from_device in overlapped)


SAMPLED = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_p=0.9, seed=4),
           SamplingParams(temperature=0.6, top_k=20, seed=5), SamplingParams(temperature=0.9, min_p=0.05, seed=6)]


def with_logprobs(engine, requests):
    """Completions and each request's logprob entries, as the events brought them."""
    entries = {}
    for r in requests:
        r.on_event = lambda e: entries.setdefault(e.request_id, []).extend(e.logprobs or [])
    return engine.generate(requests), entries


def test_sampled_lanes_and_lanes_with_logprobs_overlap_exactly(dense_dir, drafter_dir, overlapped):
    # Seeded draws keyed by the device's positions, and logprobs read as the round lands:
    # token for token (and logprob for logprob) what a plain run gives.
    requests = lambda: ([Request(p, MAX_TOKENS, s, id=f"s{i}") for i, (p, s) in enumerate(zip(PROMPTS, SAMPLED))]
                        + [Request(PROMPTS[4], MAX_TOKENS, SAMPLED[0], id="lp-sampled", logprobs=3),
                           Request(PROMPTS[5], MAX_TOKENS, id="lp-greedy", logprobs=0)])
    reference, expected = with_logprobs(engine_for(dense_dir, lanes=6), requests())
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS[:4] + PROMPTS[4:6], [r.token_ids for r in reference]), lanes=6)
    done, got = with_logprobs(engine, requests())
    assert [d.token_ids for d in done] == [r.token_ids for r in reference]
    for key in ("lp-sampled", "lp-greedy"):
        assert [(e.token_id, [t for t, _ in e.top]) for e in got[key]] == [(e.token_id, [t for t, _ in e.top]) for e in expected[key]]
        # A verify of several rows rounds a little differently from a one-row step.
        assert [e.logprob for e in got[key]] == pytest.approx([e.logprob for e in expected[key]], abs=1e-4)
    assert sum(1 for _, from_device in overlapped if from_device) >= 4
    assert sum(d.draft.accepted for d in done) >= 12


@pytest.mark.parametrize("steady_shapes", [False, True])
def test_lanes_with_repetition_penalties_overlap_exactly(steady_shapes, dense_dir, drafter_dir, overlapped):
    # What a lane has seen is kept on the device: its tokens, the kept ones of the round
    # in flight, and in a round each row's drafts before it.
    settings = [dict(temperature=0.7, top_p=0.95, repetition_penalty=1.2), dict(repetition_penalty=1.3), dict(),
                dict(temperature=0.9, min_p=0.05, repetition_penalty=1.1)]
    prompts = [PROMPTS[i] + [40 + i] for i in range(8)]
    requests = lambda: [Request(p, MAX_TOKENS, SamplingParams(seed=70 + i, **settings[i % 4])) for i, p in enumerate(prompts)]
    reference = engine_for(dense_dir, lanes=8).generate(requests())
    engine = engine_for(dense_dir, drafter_dir, sequences_of(prompts, [r.token_ids for r in reference]), lanes=8,
                        steady_shapes=steady_shapes)
    done = engine.generate(requests())
    assert [d.token_ids for d in done] == [r.token_ids for r in reference]
    assert sum(1 for _, from_device in overlapped if from_device) >= 4
    assert sum(d.draft.accepted for d in done) >= 16


def test_prompt_lookup_takes_its_rounds_in_step_and_the_rest_overlap(dense_dir, drafter_dir, plain, overlapped):
    # Where a lane's reply loops, a lookup is worth more than the (random) drafter's
    # proposal: those rounds run one at a time with the lookup found at the anchor, the
    # others overlap; every token is the plain run's.
    engine = engine_for(dense_dir, drafter_dir, None, lanes=8, prompt_lookup=2)
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:8]])
    assert [d.token_ids for d in done] == plain[:8]
    assert sum(d.draft.looked_up_rounds for d in done) >= 2
    assert sum(1 for _, from_device in overlapped if from_device) >= 4


def test_noise_keys_on_the_device_are_the_hosts():
    seeds = [0, 1, 2**32 + 7, 2**64 - 1, 123456789012345]
    positions = [[0, 1, 2], [5, 6, 7], [2**20, 2**20 + 1, 9], [70000, 3, 4], [1, 1, 2]]
    device = noise_keys_on_device(seeds, mx.array(positions, dtype=mx.int32)).tolist()
    assert device == [[noise_key(s, p) for p in row] for s, row in zip(seeds, positions)]


def test_overlapped_rounds_record_prefix_blocks_that_resume_exactly(dense_dir, drafter_dir, plain, overlapped):
    sequences = sequences_of(PROMPTS, plain)
    engine = engine_for(dense_dir, drafter_dir, sequences, lanes=4, prefix_cache_bytes=1 << 26, prefix_block_tokens=16)
    first = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[12:16]])
    # The replies' blocks were counted as their rounds landed: the whole conversation resumes.
    follow_ups = [p + d.token_ids + [7, 8, 9] for p, d in zip(PROMPTS[12:16], first)]
    again = engine.generate([Request(p, 16) for p in follow_ups])
    fresh = engine_for(dense_dir, lanes=4).generate([Request(p, 16) for p in follow_ups])
    assert [d.token_ids for d in first] == plain[12:16]
    assert [d.token_ids for d in again] == [f.token_ids for f in fresh]
    assert all(d.cached_tokens >= len(p) - 16 for d, p in zip(again, PROMPTS[12:16]))
    assert any(from_device for _, from_device in overlapped)


def test_long_replies_reach_the_context_limit_exactly(tmp_path, overlapped):
    # Replies to the limit: each in-flight round's bound on the lanes' lengths must follow
    # what they kept, not every round's width, or the next round would claim the context
    # was exceeded long before it is.
    target = make_tiny_target(tmp_path / "short", "lfm2", seed=1, shape=TinyShape(max_position=200))
    drafter = make_tiny_drafter(tmp_path / "drafter", target, seed=5, block_size=9)
    prompts = [p[:8] for p in PROMPTS[:3]]
    limit = 200 - 8
    plain = engine_for(target, lanes=3).generate([Request(p, limit) for p in prompts])
    assert max(len(c.token_ids) for c in plain) == limit  # one reply at least reaches the limit
    drafted = engine_for(target, drafter, sequences_of(prompts, [c.token_ids for c in plain]), lanes=3)
    done = drafted.generate([Request(p, limit) for p in prompts])
    assert [(d.token_ids, d.finish_reason) for d in done] == [(c.token_ids, c.finish_reason) for c in plain]
    assert sum(1 for _, from_device in overlapped if from_device) >= 20


def test_overlapped_rounds_through_the_kernels_paths_equal_plain(tmp_path, monkeypatch, overlapped):
    # What CUDA runs: the attention kernel reads the device's lengths as its offsets and
    # the conv kernel keeps states by the device's counts (both emulated here).
    calls = []
    monkeypatch.setattr(attention_kernel, "pool_attention", lambda *a, **kw: calls.append("attention") or emulated_pool_attention(*a, **kw))
    monkeypatch.setattr(conv_kernel, "gated_conv", emulated_gated_conv)
    monkeypatch.setattr(conv_kernel, "kept_states", lambda *a: calls.append("kept") or emulated_kept_states(*a))
    target = make_tiny_target(tmp_path / "wide", "lfm2", seed=3, shape=TinyShape(hidden=128))
    drafter = make_tiny_drafter(tmp_path / "wide_drafter", target, seed=4, block_size=9, head_dim=32)
    plain = [c.token_ids for c in engine_for(target, lanes=3).generate([Request(p, 40) for p in PROMPTS[:3]])]
    engine = engine_for(target, drafter, sequences_of(PROMPTS[:3], plain), lanes=3)
    model, context = engine.target.model, engine.drafter.drafter.model
    for layer in model.layers:
        (layer.self_attn if layer.is_attention else layer.conv).by_kernel = True
    for layer in context.layers:
        layer.self_attn.by_kernel = True
    done = engine.generate([Request(p, 40) for p in PROMPTS[:3]])
    assert [d.token_ids for d in done] == plain
    assert sum(1 for _, from_device in overlapped if from_device) >= 4 and {"attention", "kept"} <= set(calls)


def test_moe_overlapped_equals_plain(moe_dir, moe_drafter_dir, overlapped):
    plain = [c.token_ids for c in engine_for(moe_dir, lanes=4).generate([Request(p, 32) for p in PROMPTS[:4]])]
    engine = engine_for(moe_dir, moe_drafter_dir, sequences_of(PROMPTS[:4], plain), lanes=4)
    done = engine.generate([Request(p, 32) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain
    assert any(from_device for _, from_device in overlapped)


def test_acceptance_on_the_device_is_the_hosts():
    rng = np.random.default_rng(0)
    for width in (1, 2, 5, 10):
        choices = rng.integers(0, 3, (64, width))
        fed = np.where(rng.random((64, width)) < 0.8, np.roll(choices, 1, axis=1), rng.integers(0, 3, (64, width)))
        depths = [int(d) for d in rng.integers(0, width, 64)]
        kept = accepted_on_device(mx.array(fed), mx.array(choices), depths).tolist()
        assert kept == [greedy_accept_length(list(f[1 : 1 + d]), list(c)) for f, c, d in zip(fed, choices, depths)]


# ---- the family's device-length paths ------------------------------------------------


def prefilled(path, drafter_dir, lengths):
    """A target and drafter with one lane per length, each holding that many prompt tokens."""
    loaded = open_target(path, max_lanes=len(lengths))
    target = loaded.target
    drafter = load_drafter(drafter_dir, target.model, target.config, max_lanes=len(lengths))
    lanes = []
    for i, n in enumerate(lengths):
        slot, context = target.open_lane(), drafter.open_lane()
        tokens = PROMPTS[i % len(PROMPTS)] * (n // len(PROMPTS[i % len(PROMPTS)]) + 1)
        out = target.forward([slot], [tokens[:n]], taps=drafter.tap_layers)
        target.commit(out, [n])
        drafter.append([context], [out.taps], [tokens[:n]])
        lanes.append((slot, context))
    mx.eval(target.state_arrays(), drafter.state_arrays())
    return target, drafter, lanes


@pytest.mark.parametrize("bucket", [1, 256])
def test_a_forward_at_device_lengths_equals_one_at_host_lengths(bucket, dense_dir, drafter_dir):
    lengths, width, kept = [9, 30, 17], 4, [1, 4, 2]
    fed = mx.array([[3 + i + k for k in range(width)] for i in range(len(lengths))], dtype=mx.int32).reshape(-1)
    results = []
    for device in (False, True):
        target, _, lanes = prefilled(dense_dir, drafter_dir, lengths)
        slots = [slot for slot, _ in reversed(lanes)]  # not in slot order: the lengths follow the lanes
        held = [slot.length for slot in slots]
        at = DeviceLengths(mx.array(held, dtype=mx.int32), tuple(h + 5 for h in held)) if device else None
        out = target.forward(slots, fed, widths=[width] * 3, key_bucket=bucket, at=at)
        if device:
            target.keep(out, mx.array(kept, dtype=mx.int32))
            target.count(out, kept)
        else:
            target.commit(out, kept)
        # The next round reads what the first kept.
        after = target.forward(slots, fed[: 3], widths=[1] * 3)
        results.append((out.logits, after.logits, [slot.length for slot in slots]))
    (logits, next_logits, counted), (device_logits, device_next, device_counted) = results
    assert counted == device_counted == [h + k for h, k in zip([17, 30, 9], kept)]
    assert mx.allclose(logits, device_logits, atol=1e-5).item()
    assert mx.allclose(next_logits, device_next, atol=1e-5).item()


def test_a_drafter_window_appended_at_device_lengths_equals_its_kept_rows_appended(dense_dir, drafter_dir):
    lengths, width, kept = [12, 5], 6, [3, 6]
    taps = None
    proposals, contexts = [], []
    for window in (False, True):
        target, drafter, lanes = prefilled(dense_dir, drafter_dir, lengths)
        contexts_of = [context for _, context in lanes]
        if taps is None:
            taps = mx.random.normal((len(lengths) * width, len(drafter.tap_layers) * target.config.hidden_size),
                                    key=mx.random.key(0))
        tokens = [[5 + k for k in range(n)] for n in kept]
        if window:
            held = [c.length for c in contexts_of]
            drafter.append_window(contexts_of, taps, width, DeviceLengths(mx.array(held, dtype=mx.int32), tuple(held)))
            drafter.landed(contexts_of, tokens)
        else:
            drafter.append(contexts_of, [taps[i * width : i * width + n] for i, n in enumerate(kept)], tokens)
        n = [c.length for c in contexts_of]
        contexts.append([drafter.context_rows(c, 0, length) for c, length in zip(contexts_of, n)])
        at = DeviceLengths(mx.array(n, dtype=mx.int32), tuple(n)) if window else None
        proposal = drafter.propose(contexts_of, mx.array([7, 8]) if window else [7, 8], 5, at=at)
        proposals.append((proposal.tokens, proposal.confidences))
    assert [len(c) for c in contexts[0]] == [len(c) for c in contexts[1]]
    for rows, window_rows in zip(contexts[0], contexts[1]):
        for a, b in zip(rows, window_rows):
            assert mx.allclose(a, b, atol=1e-5).item()
    assert mx.array_equal(proposals[0][0], proposals[1][0]).item()
    assert mx.allclose(proposals[0][1], proposals[1][1], atol=1e-5).item()


def test_scripted_proposals_from_the_device_equal_the_hosts(dense_dir, drafter_dir, plain):
    sequences = sequences_of(PROMPTS, plain)
    target, real, lanes = prefilled(dense_dir, drafter_dir, [len(p) - 1 for p in PROMPTS[:3]])
    scripted = ScriptedDrafter(real, sequences, published_profile(), target.vocab_size)
    contexts = [context for _, context in lanes]
    for context, prompt in zip(contexts, PROMPTS):
        scripted._history[context.slot] = prompt[:-1]
    anchors = [p[-1] for p in PROMPTS[:3]]
    host = scripted.propose(contexts, anchors, 9)  # matches each lane to its sequence
    held = [c.length for c in contexts]
    device = scripted.propose(contexts, mx.array(anchors), 9, at=DeviceLengths(mx.array(held, dtype=mx.int32), tuple(held)))
    assert device.tokens.tolist() == host.tokens.tolist()
    # Further on, past where the host has read: the block the host would script there.
    for context, prompt, out in zip(contexts, PROMPTS, plain):
        scripted._history[context.slot] = prompt + out[:10]
    later = [out[10] for out in plain[:3]]
    host = scripted.propose(contexts, later, 9)
    ahead = [h + 11 for h in held]
    device = scripted.propose(contexts, mx.array(later), 9, at=DeviceLengths(mx.array(ahead, dtype=mx.int32), tuple(ahead)))
    assert device.tokens.tolist() == host.tokens.tolist()


@pytest.mark.parametrize("scripted", [False, True])
def test_a_server_built_on_a_loader_thread_serves_overlapped_rounds(scripted, dense_dir, drafter_dir, overlapped,
                                                                    monkeypatch):
    """As `serve` on CUDA: the engine (laneserve's, or serve_scripted's) is built on a
    worker thread and its rounds, warm-up first, overlap on the engine thread. MLX
    streams are thread-local, so nothing built on the first may be left for the second
    to evaluate."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.serve_scripted import scripted_engine
    from daemon import cli
    from daemon.serve import ServerConfig, open_serving
    from families.lfm2.target import Lfm2Target
    from lanes.engine import Engine

    monkeypatch.setattr(Lfm2Target, "runs_behind_host", staticmethod(lambda: True))
    monkeypatch.setattr(Lfm2Target, "plans_per_shape", staticmethod(lambda: True))
    args = cli.parser().parse_args(["serve", "--model", str(dense_dir), "--draft-model", str(drafter_dir),
                                    "--max-streams", "2"])
    args.prefix_cache_bytes = 0
    with ThreadPoolExecutor(1) as loader:
        serving, _ = loader.submit(open_serving, args, ServerConfig("tiny"),
                                     scripted_engine("published") if scripted else Engine).result()
    try:
        assert serving.client.wait_ready(120), serving.client.health().error
        plain_reply, = serving.client.generate([Request(PROMPTS[2], 24, draft=False)])
        drafted_reply, = serving.client.generate([Request(PROMPTS[2], 24)])
    finally:
        serving.client.shutdown(0)
    assert drafted_reply.token_ids == plain_reply.token_ids
    assert overlapped, "no drafted round overlapped"


@pytest.mark.parametrize("flags, overlap", [([], None), (["--no-overlap"], False)])
def test_no_overlap_reaches_the_engine_from_generate_and_serve(flags, overlap, dense_dir, drafter_dir, monkeypatch):
    from daemon import cli
    from daemon.serve import ServerConfig, open_serving
    from lanes.engine import Engine

    configs = []

    def recording(*args):
        configs.append(args[-1])
        return Engine(*args)

    monkeypatch.setattr(cli, "Engine", recording)
    assert cli.main(["generate", "--model", str(dense_dir), "--draft-model", str(drafter_dir), "--prompt-ids", "1,5,9",
                     "--max-tokens", "4", "--json", *flags]) == 0
    args = cli.parser().parse_args(["serve", "--model", str(dense_dir), "--draft-model", str(drafter_dir), "--max-streams", "2",
                                    *flags])
    args.prefix_cache_bytes = 0  # as run_serve leaves it, parsed
    serving, _ = open_serving(args, ServerConfig("tiny"), build_engine=recording)
    serving.client.shutdown(0)
    assert [config.overlap for config in configs] == [overlap, overlap]


@pytest.mark.parametrize("steady", [True, False])
def test_the_first_round_of_each_shape_is_not_timed_as_evidence(steady, dense_dir, drafter_dir, plain):
    # A shape's first round traces (and on CUDA plans) for it, steady shapes or not: that
    # round feeds neither the guard nor the cost table; every round counts in the counters.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=6, steady_shapes=steady)
    runner = engine.rounds
    reports, guarded, costed = [], [], []
    record, guard_record, observe = runner.counters.record, runner.guard.record, runner.costs.observe
    runner.counters.record = lambda report: (reports.append(report), record(report))
    runner.guard.record = lambda *args: (guarded.append(args), guard_record(*args))
    runner.costs.observe = lambda *args: (costed.append(args), observe(*args))
    # Lanes of different lengths end one by one: rounds of 6, 5, ... lanes, plain and drafted.
    done = engine.generate([Request(p, 12 + 6 * i) for i, p in enumerate(PROMPTS[:6])])
    assert [d.token_ids for d in done] == [t[: 12 + 6 * i] for i, t in enumerate(plain[:6])]
    seen, firsts = set(), []
    for report in reports:
        drafted = report.kind == "drafted" or report.kind == "probe" and report.decision.draft
        shape = ("drafted" if drafted else "plain", report.overlapped, report.lanes, report.rows)
        firsts.append(shape not in seen)
        seen.add(shape)
    assert [report.first_of_shape for report in reports] == firsts
    assert len({(r.lanes, r.rows) for r in reports}) >= 6 and any(r.kind != "plain" for r in reports)
    assert len(guarded) == sum(1 for r in reports if r.decision is not None and not r.first_of_shape)
    assert len(costed) == sum(1 for r in reports if not r.first_of_shape)
    assert any(firsts)


class PlainCostsByLanes(FlatCosts):
    """Verifies priced flat; a plain round of L lanes costs (1 + L) ms."""

    def plain_estimate(self, lanes: int, context_tokens: int) -> float:
        return 0.001 * (1 + lanes)


def test_the_guard_is_fed_each_rounds_tokens_counted_at_its_bands_smallest_lane_count(dense_dir, drafter_dir, plain):
    # A band holds rounds of several lane counts: the guard is fed a round's tokens weighed
    # by what a token costs plain rounds of its lanes against plain rounds of the band's
    # smallest lane count (lanes/guard.py), from the cost table.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=6)
    runner = engine.rounds
    runner.guard, runner.costs = EveryThirdPlain(), PlainCostsByLanes()
    fed, paired = [], []
    record = runner.counters.record
    runner.guard.record = lambda decision, seconds, tokens: fed.append((seconds, tokens))
    runner.counters.record = lambda report: (paired.append((report, fed.pop() if fed else None)), record(report))
    done = engine.generate([Request(p, 12 + 6 * i) for i, p in enumerate(PROMPTS[:6])])
    assert [d.token_ids for d in done] == [t[: 12 + 6 * i] for i, t in enumerate(plain[:6])]
    checked = [(report, got) for report, got in paired if got is not None]
    token_seconds = lambda lanes: 0.001 * (1 + lanes) / lanes
    for report, (seconds, tokens) in checked:
        floor = {1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4}[report.lanes]  # the lanes bands 1, 2-3, 4-7
        assert seconds == report.seconds
        assert tokens == pytest.approx(report.emitted * token_seconds(report.lanes) / token_seconds(floor))
    assert {r.lanes for r, _ in checked} >= {5, 6} and {r.kind for r, _ in checked} >= {"plain", "drafted"}


class DraftsPricedOut(FlatCosts):
    """A row past each lane's anchor costs a hundred rounds: pricing takes no draft."""

    def curve(self, lanes: int, context_tokens: int):
        return lambda rows: 1.0 if rows <= lanes else 100.0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-step"])
def test_a_round_whose_every_window_prices_out_runs_plain(overlap, dense_dir, drafter_dir, plain, monkeypatch):
    # Priced ahead of the proposal, a round whose every window takes no draft would run
    # the drafter's forward and a one-row verify per lane for a plain round's tokens: it
    # runs as a plain round, the drafter never asked, and the guard, whose choice it
    # was, is fed it.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=4, overlap=overlap)
    runner = engine.rounds
    runner.costs = DraftsPricedOut()
    choices_fed, proposals = [], []
    runner.guard.record = lambda decision, seconds, tokens: choices_fed.append(decision.draft)
    propose = runner.drafter.propose
    monkeypatch.setattr(runner.drafter, "propose", lambda *args, **kwargs: proposals.append(1) or propose(*args, **kwargs))
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    assert proposals == [] and runner.counters.snapshot()["rounds_by_mode"].get("drafted", 0) == 0
    assert len(choices_fed) >= MAX_TOKENS - 2 and all(choices_fed)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "in-step"])
def test_a_drafted_round_prices_its_windows_once(overlap, dense_dir, drafter_dir, plain, monkeypatch):
    # The check that a round's windows take some draft prices them; the round reuses
    # those depths rather than pricing the same windows again.
    engine = engine_for(dense_dir, drafter_dir, sequences_of(PROMPTS, plain), lanes=4, overlap=overlap)
    runner = engine.rounds
    priced = []
    price = runner._price
    monkeypatch.setattr(runner, "_price", lambda *args: priced.append(1) or price(*args))
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    drafted = runner.counters.snapshot()["rounds_by_mode"]["drafted"]
    assert drafted >= 8 and len(priced) <= drafted + 4  # repriced only where a lane ends or leaves the drafting



def test_depths_priced_before_a_round_lands_are_priced_afresh_after(tmp_path, monkeypatch):
    # In step, rounds switching between plain and drafted land a plain round between the
    # check that prices a drafted round's windows and that round: the lanes have moved on
    # by a token, and a window priced before could take a draft more than a lane has room
    # for. Every window the round verifies fits its lane as the round finds it.
    target = make_tiny_target(tmp_path / "short", "lfm2", seed=1, shape=TinyShape(max_position=120))
    drafter = make_tiny_drafter(tmp_path / "drafter", target, seed=5, block_size=9)
    prompts = [p[:8] for p in PROMPTS[:3]]
    plain = engine_for(target, lanes=3).generate([Request(p, 24 + 16 * i) for i, p in enumerate(prompts)])
    engine = engine_for(target, drafter, sequences_of(prompts, [c.token_ids for c in plain]), lanes=3, overlap=False)
    engine.rounds.guard = EveryThirdPlain()
    windows, room = RoundRunner._windows, []

    def fitted(lanes, drafting, drafts, depths):
        room.extend(lane.remaining - 1 - depth for lane, depth in zip(drafting, depths))
        return windows(lanes, drafting, drafts, depths)

    monkeypatch.setattr(RoundRunner, "_windows", staticmethod(fitted))
    done = engine.generate([Request(p, 24 + 16 * i) for i, p in enumerate(prompts)])
    assert [d.token_ids for d in done] == [c.token_ids for c in plain]
    assert len(room) >= 10 and min(room) >= 0 and 0 in room  # some window filled its lane's room exactly

"""The engine: concurrent lanes equal their solo runs, cancellation touches no neighbour and
frees memory, long prompts are read in slices, limits refuse by name."""

from __future__ import annotations

import gc
import threading

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import open_target
from lanes.client import EngineClient
import lanes.engine as engine_module
from lanes.engine import Engine, EngineConfig, QueueFull, RequestError
from lanes.guard import DraftGuard
from lanes.lane import FinishReason, Request
from lanes.pricing import CostTable
from lanes.round import RoundRunner
from lanes.sampling import SamplingParams
from lanes.warmup import profile, prompt_shapes
from tests.priced import (
    assert_drafted,
    fewest_drafted_rounds,
    price_without_timing,
    tiny_engine,
)

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(100 + i).integers(15, 500, 3 + 2 * i)] for i in range(16)]
LENGTHS = [12 + 3 * (i % 7) for i in range(16)]
PRICED_WIDTH = 10  # the widest window priced rounds verify: the anchor and the drafter's block of 9


def make_engine(path, drafter_dir=None, sequences=None, lanes=16, timed=True, **config):
    return tiny_engine(path, drafter_dir, lanes, sequences, timing="warm" if timed else "flat", **config)


@pytest.fixture(scope="module")
def solo(dense_dir):
    """Each prompt run alone, plain."""
    return [make_engine(dense_dir, lanes=1).generate([Request(p, n)])[0].token_ids for p, n in zip(PROMPTS, LENGTHS)]


def sequences(solo):
    return [p + s for p, s in zip(PROMPTS, solo)]


def assert_scripted_drafting(completions, outputs):
    """Priced scripted lanes draft every round they may, each round keeping at most
    PRICED_WIDTH tokens; the published profile keeps a round's first draft 86.5% of the
    time, so half as many accepts as those rounds is a floor with room."""
    rounds = fewest_drafted_rounds(outputs, PRICED_WIDTH)
    assert_drafted(completions, rounds, rounds // 2)


class Finished(dict):
    """An on_event that keeps each request's completion, by id."""

    def __call__(self, event):
        if event.completion is not None:
            self[event.request_id] = event.completion


@pytest.mark.parametrize("mode, steady", [("plain", False), ("drafted", False), ("mixed", False), ("plain", True), ("mixed", True)])
def test_sixteen_concurrent_replies_equal_their_solo_runs(mode, steady, dense_dir, drafter_dir, solo):
    # steady: rounds padded to the shape buckets a CUDA backend gets (rows, key spans).
    engine = make_engine(dense_dir, None if mode == "plain" else drafter_dir, sequences(solo), timed=False, steady_shapes=steady)
    done = Finished()
    requests = [Request(p, n, draft=mode == "drafted" or i % 2 == 0, on_event=done) for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    # Half arrive while the first half is already decoding.
    for request in requests[:8]:
        engine.submit(request)
    for _ in range(6):
        engine.step()
    for request in requests[8:]:
        engine.submit(request)
    engine.run_until_idle()
    assert [done[r.id].token_ids for r in requests] == solo
    counters = engine.rounds.counters.snapshot()
    assert counters["emitted_tokens"] == sum(len(t) for t in solo) - len(solo)  # first tokens come from prefill
    if mode != "plain":
        drafting = [i for i, r in enumerate(requests) if r.draft]
        assert_scripted_drafting([done[requests[i].id] for i in drafting], [solo[i] for i in drafting])
        accepted = sum(done[r.id].draft.accepted for r in requests)
        assert sum(counters["accepted_per_position"]) == accepted
        assert counters["rounds_by_kind"].get("drafted", 0) > 0 and counters["guard_reasons"]


def test_cancelling_lanes_changes_nothing_else_and_frees_memory(dense_dir, drafter_dir, solo):
    engine = make_engine(dense_dir, drafter_dir, sequences(solo), timed=False)
    # Warmed as a server is, so what first use builds for good is not counted as held by
    # lanes; the rehearsal hands the timing-free guard and costs back.
    engine.warm_up()
    mx.clear_cache()
    idle = mx.get_active_memory()
    finished = Finished()
    requests = [Request(p, n, on_event=finished) for p, n in zip(PROMPTS, LENGTHS)]
    for request in requests:
        engine.submit(request)
    for _ in range(3):
        engine.step()
    cancelled = {r.id for r in requests if r.id not in finished}
    cancelled = set(sorted(cancelled)[::3])
    assert len(cancelled) >= 3
    for request_id in cancelled:
        engine.cancel(request_id)
    engine.step()  # the next round boundary drops them
    assert all(finished[i].finish_reason is FinishReason.CANCELLED for i in cancelled)
    engine.run_until_idle()
    for request, expected in zip(requests, solo):
        done = finished[request.id]
        if request.id in cancelled:
            assert done.finish_reason is FinishReason.CANCELLED
            assert done.token_ids == expected[: len(done.token_ids)]
        else:
            assert done.token_ids == expected
    kept = [i for i, r in enumerate(requests) if r.id not in cancelled]
    assert_scripted_drafting([finished[requests[i].id] for i in kept], [solo[i] for i in kept])
    mx.clear_cache()
    assert mx.get_active_memory() <= idle
    assert engine.target.kv_bytes() == 0 and engine.drafter.kv_bytes() == 0


def test_mlx_buffer_cache_is_handed_back_when_idle_not_as_each_lane_ends(dense_dir, drafter_dir, solo, monkeypatch):
    engine = make_engine(dense_dir, drafter_dir, sequences(solo))
    calls = []
    monkeypatch.setattr(engine_module.mx, "clear_cache", lambda: calls.append(engine.running))
    finished = Finished()
    requests = [Request(p, n, on_event=finished) for p, n in zip(PROMPTS, LENGTHS)]
    assert len(set(LENGTHS)) > 1  # lanes end in different rounds
    engine.generate(requests)
    assert [finished[r.id].token_ids for r in requests] == solo
    assert calls == [0]  # once, as the last lane ended
    # A cache past what the pools reserve (and the floor) is handed back while lanes decode.
    monkeypatch.setattr(engine_module, "CACHE_HELD_FLOOR", 0)
    monkeypatch.setattr(engine_module.mx, "get_cache_memory", lambda: engine.target.kv_bytes() + engine.drafter.kv_bytes() + 1)
    calls.clear()
    engine.generate([Request(p, n) for p, n in zip(PROMPTS, LENGTHS)])
    assert len(calls) > 1 and calls[-1] == 0 and any(calls[:-1])


def test_the_warm_up_hands_its_buffers_back(dense_dir, drafter_dir, solo):
    """An engine that has warmed up and serves nothing holds no buffer cache: the warm-up's
    profile reads prompts at every steady shape, and what it allocated would otherwise stay
    cached until the first request's lanes end (on a shared GPU, beside other servers'
    warm-ups, that ran out of memory)."""
    engine = tiny_engine(dense_dir, drafter_dir, 16, sequences(solo), timing=None)
    mx.clear_cache()
    engine.warm_up()
    assert mx.get_cache_memory() == 0


def test_a_long_prompt_is_read_in_slices_while_lanes_decode(dense_dir):
    chunk = 64
    engine = make_engine(dense_dir, prefill_chunk=chunk)
    emitted: dict[str, int] = {}  # events (rounds with output) per request
    ended: set[str] = set()

    def count(event):
        emitted[event.request_id] = emitted.get(event.request_id, 0) + 1
        if event.finish_reason is not None:
            ended.add(event.request_id)

    decoders = [Request(p, 200, on_event=count) for p in PROMPTS[:15]]  # eos may end a few early
    for request in decoders:
        engine.submit(request)
    # Each decoding: its first token out, then a round's (a lane joins the rounds at the step
    # after the one that reads its first token).
    while engine.running < 15 or any(emitted.get(r.id, 0) < 2 for r in decoders):
        engine.step()
    long_prompt = [1] + [int(t) for t in np.random.default_rng(7).integers(15, 500, 1000)]
    reader = Request(long_prompt, 4, on_event=count)
    engine.submit(reader)
    slices = 0
    while emitted.get(reader.id, 0) == 0:
        before = {r.id: emitted[r.id] for r in decoders if r.id not in ended}
        engine.step()
        slices += 1
        # Every decoding lane got its token in the same iteration as one prefill slice.
        assert all(emitted[i] > count for i, count in before.items())
    assert slices == -(-len(long_prompt) // chunk)


def test_the_queue_bound_refuses_by_name(dense_dir):
    engine = make_engine(dense_dir, lanes=2, max_waiting=3)
    for p in PROMPTS[:3]:
        engine.submit(Request(p, 4))
    with pytest.raises(QueueFull, match="waiting queue is full \\(3 requests\\)"):
        engine.submit(Request(PROMPTS[3], 4))
    engine.step()  # admits two, so two places free up
    engine.submit(Request(PROMPTS[3], 4))
    engine.run_until_idle()


def test_requests_past_the_limits_are_refused_by_name(dense_dir):
    engine = make_engine(dense_dir, lanes=1)
    with pytest.raises(RequestError, match="maximum context length is 4096 tokens; the prompt has 4 and max_tokens asks for 4096"):
        engine.submit(Request(PROMPTS[0], 4096))
    with pytest.raises(RequestError, match="the prompt is empty"):
        engine.submit(Request([], 4))


def test_stop_strings_cut_the_text_across_token_boundaries(dense_dir):
    engine = make_engine(dense_dir, lanes=1)
    (full,) = engine.generate([Request(PROMPTS[5], 30)])
    ids = full.token_ids
    decode = engine.tokenizer.decode
    # A stop string that starts inside one token and ends inside a later one.
    stop = decode(ids[:9])[len(decode(ids[:6])) - 1 : len(decode(ids[:8])) + 1]
    assert stop and stop in full.text
    (cut,) = engine.generate([Request(PROMPTS[5], 30, stop=(stop,))])
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == ids[: len(cut.token_ids)]


def test_the_engine_thread_serves_requests_from_other_threads(dense_dir, solo):
    client = EngineClient(make_engine(dense_dir))
    client.start()
    try:
        requests = [Request(p, n) for p, n in zip(PROMPTS[:6], LENGTHS[:6])]
        results: dict[str, list[int]] = {}

        def ask(request):  # each sender thread on its own asyncio loop
            results[request.id] = client.generate([request])[0].token_ids

        senders = [threading.Thread(target=ask, args=(r,)) for r in requests]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=120)
        assert [results[r.id] for r in requests] == solo[:6]
        assert client.health().ok
    finally:
        client.shutdown(0)


def test_warm_up_rehearses_drafted_rounds_and_leaves_no_evidence(dense_dir, drafter_dir, solo):
    engine = make_engine(dense_dir, drafter_dir, sequences(solo), lanes=4, timed=False)
    engine.rounds.guard, engine.rounds.costs = DraftGuard(), CostTable()
    proposals = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda lanes, *args, **kwargs: proposals.append(len(lanes)) or propose(lanes, *args, **kwargs)
    before = mx.get_active_memory()

    engine.warm_up()

    assert 1 in proposals and max(proposals) > 1  # drafted rounds at one lane and at several
    assert engine.rounds.guard.snapshot() == {}
    assert engine.rounds.counters.snapshot()["rounds_by_kind"] == {}
    assert engine.in_flight == 0 and engine.running == 0
    assert engine.stats()["prompt_tokens_total"] == 0 and engine.stats()["requests_finished"] == {}
    assert engine.rounds.costs.estimate(4, 4, 64) > 0  # seeded by the profile
    assert mx.get_active_memory() <= before + (1 << 20)  # its lanes gave their caches back
    # And the engine serves exactly as before (drafting every round, whatever this
    # machine's timings would have the guard and the profiled costs decide).
    price_without_timing(engine)
    done = engine.generate([Request(p, n) for p, n in zip(PROMPTS[:4], LENGTHS[:4])])
    assert [c.token_ids for c in done] == solo[:4]
    assert_scripted_drafting(done, solo[:4])


@pytest.mark.parametrize("lanes", [1, 4])
def test_warm_up_takes_sampled_penalised_and_logprob_lanes_through_both_round_kinds(lanes, dense_dir, drafter_dir, monkeypatch):
    # A backend compiles a kernel the first time it meets it (CUDA's and Metal's JIT), so
    # the paths the default model's generation_config takes must run before a request does.
    engine = make_engine(dense_dir, drafter_dir, lanes=lanes, timed=False)
    monkeypatch.setattr(engine.target, "runs_behind_host", lambda: True)  # as on a GPU
    batches = []
    generate = engine.generate
    engine.generate = lambda requests: batches.append(requests) or generate(requests)

    engine.warm_up()

    def covered(requests, draft: bool) -> bool:
        sampled = [r for r in requests if r.draft == draft and not r.sampling.greedy]
        return any(r.sampling.repetition_penalty != 1 and r.sampling.top_p < 1 and r.sampling.top_k and r.sampling.min_p
                   and r.sampling.seed is not None for r in sampled) and any(r.logprobs for r in sampled)

    assert covered([r for b in batches if len(b) == 1 for r in b], draft=True)  # one lane
    assert covered([r for b in batches if len(b) == lanes for r in b], draft=True)  # every lane
    assert covered([r for b in batches for r in b], draft=False)
    assert any(r.sampling.greedy for b in batches for r in b if r.draft)
    assert engine.stats()["requests_finished"] == {}


class SynchronousRounds(RoundRunner):
    """Lands every plain round before building the next: the rounds pipelining overlaps."""

    _pipelinable = staticmethod(lambda lane: False)


def test_pipelined_plain_rounds_equal_synchronous_ones(dense_dir):
    # A pipelined round feeds the round before's choices while they are still on the
    # device: a penalty must count them as seen, and a sampled row must draw at the
    # position one ahead of what the host knows. Six lanes on four slots, so the set of
    # lanes changes as they end and join: the rounds go on pipelined, a lane that joined
    # feeding its anchor from the host beside the others' choices on the device.
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.5, top_k=4, repetition_penalty=1.3, seed=2),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(temperature=0.3, min_p=0.05, repetition_penalty=1.2, seed=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=4),
    ]
    replies, logprobs = {}, {}
    for kind in (RoundRunner, SynchronousRounds):
        entries = logprobs[kind] = {}
        on_event = lambda event: entries.setdefault(event.request_id.rsplit("-", 1)[1], []).extend(event.logprobs or [])
        requests = [Request(p, n, s, id=f"{kind.__name__}-{i}", logprobs=2, on_event=on_event)
                    for i, (p, n, s) in enumerate(zip(PROMPTS, LENGTHS, settings))]
        loaded = open_target(dense_dir, max_lanes=4)
        rounds = kind(loaded.target)
        aheads = []  # per round: how far ahead of the host each lane fed (None: from the host)
        dispatch = rounds._dispatch
        rounds._dispatch = lambda lanes, anchors, ahead=None: (
            aheads.append(ahead if isinstance(anchors, mx.array) else None) or dispatch(lanes, anchors, ahead))
        engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, config=EngineConfig(max_streams=4), rounds=rounds)
        replies[kind] = engine.generate(requests)
        if kind is RoundRunner:  # most rounds ran pipelined, lanes that joined among them
            pipelined = [a for a in aheads if a is not None]
            assert len(pipelined) > aheads.count(None) > 0
            assert any(0 in a and 1 in a for a in pipelined)
        else:
            assert aheads and all(a is None for a in aheads)
    pipelined, synchronous = replies[RoundRunner], replies[SynchronousRounds]
    assert [c.token_ids for c in pipelined] == [c.token_ids for c in synchronous]
    ids = lambda entries: [(e.token_id, [t for t, _ in e.top]) for e in entries]
    values = lambda entries: [v for e in entries for v in (e.logprob, *(lp for _, lp in e.top))]
    assert logprobs[RoundRunner].keys() == logprobs[SynchronousRounds].keys()
    for lane, entries in logprobs[RoundRunner].items():
        assert ids(entries) == ids(logprobs[SynchronousRounds][lane])
        assert values(entries) == pytest.approx(values(logprobs[SynchronousRounds][lane]), abs=1e-5)


def test_a_prompt_read_beside_a_pipelined_round_is_not_counted_as_its_time(dense_dir):
    # A prompt's chunk is read between a plain round's launch and its landing: the host's
    # time reading it must not count as the round's, or the guard and the cost table see
    # plain rounds slowed by every prompt read beside them. A clock that moves 1 ms per
    # round's forward and 1 s as a chunk is launched (when its state is handed to the
    # device) shows which is counted.
    now = [0.0]

    def clock():
        now[0] += 1e-6
        return now[0]

    loaded = open_target(dense_dir, max_lanes=2)
    target = loaded.target
    forward = target.forward

    reading = [False]
    state_arrays = target.state_arrays

    def timed_forward(lanes, tokens, **kwargs):
        reading[0] = kwargs.get("logits") == "last"
        now[0] += 0.0 if reading[0] else 1e-3
        return forward(lanes, tokens, **kwargs)

    def timed_state_arrays():
        if reading[0]:
            now[0] += 1.0
            reading[0] = False
        return state_arrays()

    target.forward, target.state_arrays = timed_forward, timed_state_arrays
    rounds = RoundRunner(target, clock=clock)
    seconds = []
    account = rounds._account
    reports, observed = [], []
    rounds._account = lambda report, decision, context: reports.append(report) or account(report, decision, context)
    observe = rounds.costs.observe
    rounds.costs.observe = lambda *args: observed.append(args) or observe(*args)
    engine = Engine(target, loaded.tokenizer, loaded.eos_ids, config=EngineConfig(max_streams=2, prefill_chunk=8), rounds=rounds)
    decoder = Request(PROMPTS[0], 40)
    engine.submit(decoder)
    while not reports:
        engine.step()
    reader = [1] + list(range(20, 84))
    engine.submit(Request(reader, 4))  # read in 9 slices beside the decoder's rounds
    engine.run_until_idle()
    seconds = [report.seconds for report in reports]
    assert len(seconds) > 20 and max(seconds) < 0.1, max(seconds)
    # The device's time for a slice that ends no prompt (none waits for it) may fall in the
    # round launched next: that round is not evidence.
    assert sum(report.behind_prompt for report in reports) == -(-len(reader) // 8) - 1
    assert len(observed) == sum(1 for report in reports if not (report.first_of_shape or report.behind_prompt))


def test_a_round_that_fails_after_a_lane_ended_in_it_still_sends_that_lanes_last_event(dense_dir, solo):
    # A round lands the round before (a lane ends there) and then fails building its own:
    # the ended lane's final event goes out with its tokens, the others end in an error.
    engine = make_engine(dense_dir, lanes=3)
    run = engine.rounds.run

    def failing_once_a_lane_ended(lanes):
        events = run(lanes)
        if any(event.finish_reason is not None for _, event in events):
            raise RuntimeError("building the next round failed")
        return events

    engine.rounds.run = failing_once_a_lane_ended
    finished = Finished()
    lengths = [4, LENGTHS[1], LENGTHS[2]]
    for p, n in zip(PROMPTS[:3], lengths):
        engine.submit(Request(p, n, on_event=finished))
    engine.run_until_idle()
    done = [finished[r] for r in sorted(finished)]
    assert len(done) == 3
    ended = [d for d in done if d.finish_reason is FinishReason.LENGTH]
    assert [d.token_ids for d in ended] == [solo[0][:4]]
    assert all(d.finish_reason is FinishReason.ERROR and "building the next round failed" in d.error
               for d in done if d not in ended)


def test_a_steady_warm_up_reads_every_steady_prompt_shape_into_fresh_lanes(dense_dir, drafter_dir, monkeypatch):
    # A backend that plans per shape meets each steady prompt chunk at warm-up, not when
    # a request's lane joins: chat-sized chunks at every lane count, longer ones alone,
    # into lanes holding nothing (a new prompt's keys span its own rows), with and
    # without the drafter's taps, on the first slots and on others (as a lane joining
    # on an ended lane's slot reads, a trace of its own).
    engine = make_engine(dense_dir, drafter_dir, lanes=3, timed=False, steady_shapes=True)
    reads = set()
    forward = engine.target.forward

    def watched(lanes, tokens, **kwargs):
        if kwargs.get("steady"):
            reads.add((len(lanes), len(tokens[0]), bool(kwargs.get("taps")), max(lane.length for lane in lanes), lanes[0].slot))
        return forward(lanes, tokens, **kwargs)

    monkeypatch.setattr(engine.target, "forward", watched)
    profile(engine.rounds, 3, prompt_chunk=200)
    shapes = prompt_shapes(engine.target, 3, 200)
    assert shapes == [(n, w) for n in (1, 2, 3) for w in (1, 2, 4, 8, 16, 32, 64)] + [(1, 128), (1, 192), (1, 256)]
    assert reads == {(n, w, taps, 0, first) for n, w in shapes for taps in (False, True) for first in ((0, 1) if n < 3 else (0,))}


def test_the_steady_warm_up_does_not_keep_every_prompt_shapes_buffers_cached(dense_dir, drafter_dir, monkeypatch):
    # Each steady prompt shape allocates buffers of sizes of its own; kept cached all at
    # once (MLX's CUDA cache is bounded by the device's memory alone) they outgrew a GPU
    # that three servers warmed up on together.
    engine = make_engine(dense_dir, drafter_dir, lanes=16, timed=False, steady_shapes=True)
    forward = engine.target.forward

    def peak_cache() -> int:
        cached = [0]

        def watched(lanes, tokens, **kwargs):
            if kwargs.get("steady"):
                cached[0] = max(cached[0], mx.get_cache_memory())
            return forward(lanes, tokens, **kwargs)

        monkeypatch.setattr(engine.target, "forward", watched)
        # Earlier tests' engines can linger in reference cycles: collected in the middle
        # of the warm-up, their arrays' buffers would land in the cache it is bounding.
        gc.collect()
        gc.disable()
        try:
            mx.clear_cache()
            profile(engine.rounds, 16, prompt_chunk=256)
        finally:
            gc.enable()
        return cached[0]

    limit = mx.set_cache_limit(1 << 32)
    try:
        bounded = peak_cache()
        monkeypatch.setattr(mx, "clear_cache", lambda: None)
        assert bounded < peak_cache() / 2
    finally:
        mx.set_cache_limit(limit)

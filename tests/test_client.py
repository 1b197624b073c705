"""The engine boundary the daemon stands on: every request ends with one final event
(cancelled queued or running, faulted, shut down, engine gone), nothing is held after,
drafting never changes which ids come back, and the heartbeat tells live from stalled."""

from __future__ import annotations

import asyncio
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.client import EngineClient, EngineUnavailable
from lanes.engine import Engine, EngineConfig, RequestError
from lanes.lane import FinishReason, Request
from lanes.sampling import SamplingParams
from tests.priced import assert_drafted, fewest_drafted_rounds, tiny_engine

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(300 + i).integers(15, 500, 4 + 3 * i)] for i in range(16)]
LIMIT = 96  # a short context, so lanes reach it


@pytest.fixture(scope="module")
def short_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("short"), "lfm2", seed=21, shape=TinyShape(max_position=LIMIT))


@pytest.fixture(scope="module")
def short_drafter_dir(short_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("short_drafter"), short_dir, seed=22, block_size=9)


def engine(path, drafter_dir=None, sequences=None, lanes=16, **config) -> Engine:
    return tiny_engine(path, drafter_dir, lanes, sequences, **config)


@pytest.fixture(scope="module")
def plain(short_dir):
    return [c.token_ids for c in engine(short_dir).generate([Request(p, 24) for p in PROMPTS])]


def sequences(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs)]


def scripted_floors(outputs, width):
    """Floors on (drafted rounds, accepted drafts) for scripted lanes that wrote `outputs`
    drafting every round at `width` rows (or priced, at most that many): the rounds they
    cannot have done without, and half as many accepts, since the published profile
    keeps a round's first draft 86.5% of the time."""
    rounds = fewest_drafted_rounds(outputs, width)
    return rounds, rounds // 2


def assert_nothing_held(built: Engine):
    # A lane's final event goes out before the engine retires it and updates its gauges,
    # so a consumer can see its completion while that iteration is still ending.
    deadline = time.monotonic() + 10
    while (built.stats()["running"] or built.stats()["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = built.stats()
    assert stats["in_flight"] == 0 and stats["queue_depth"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert built.target.kv_bytes() == 0 and built.target.kv_bytes_in_use() == 0
    if built.drafter is not None:
        assert built.drafter.kv_bytes() == 0


# ---- bugs found in the lane core, each fixed ----------------------------------------------


def test_a_lane_at_the_context_limit_shares_a_wide_drafted_round(short_dir, short_drafter_dir):
    # One prompt nearly fills the context while its neighbours draft windows of 10 rows,
    # padded to one width: padding must stop at each lane's own limit.
    near = [1] + list(range(20, 20 + LIMIT - 6))
    prompts = [near] + PROMPTS[1:4]
    alone = engine(short_dir).generate([Request(p, 5 if p is near else 30) for p in prompts])
    built = engine(short_dir, short_drafter_dir, sequences(prompts, [c.token_ids for c in alone]), lanes=4,
                   draft_width=10, steady_shapes=True)
    done = built.generate([Request(p, 5 if p is near else 30) for p in prompts])
    assert [d.error for d in done] == [None] * 4
    assert [d.token_ids for d in done] == [c.token_ids for c in alone]
    assert_drafted(done, *scripted_floors([c.token_ids for c in alone], 10))
    assert_nothing_held(built)


def test_drafting_returns_the_plain_ids_when_a_stop_string_ends_the_reply(short_dir, short_drafter_dir, plain):
    decode = open_target(short_dir, max_lanes=1).tokenizer.decode
    for i in range(4):
        ids = plain[i]
        stop = decode(ids[:7])[len(decode(ids[:5])):]  # ends inside a block of accepted drafts
        if not stop.strip():
            continue
        request = lambda: Request(PROMPTS[i], 24, stop=(stop,))
        (cut,) = engine(short_dir).generate([request()])
        for width in (3, 5, 10):
            built = engine(short_dir, short_drafter_dir, sequences(PROMPTS[i : i + 1], [ids]), lanes=1, draft_width=width)
            (drafted,) = built.generate([request()])
            # One accept at least: the stop is meant to end the reply inside accepted drafts.
            assert_drafted([drafted], fewest_drafted_rounds([cut.token_ids], width), 1)
            assert (drafted.token_ids, drafted.text, drafted.finish_reason) == (cut.token_ids, cut.text, FinishReason.STOP)


def test_a_cancel_is_never_lost_whenever_it_arrives(short_dir):
    built = engine(short_dir, lanes=2)
    finished = {}
    on_event = lambda e: e.completion and finished.setdefault(e.request_id, e.completion)
    requests = [Request(p, 24, id=f"r{i}", on_event=on_event) for i, p in enumerate(PROMPTS[:6])]
    requests[0].cancelled = False
    built.submit(requests[0])
    assert built.cancel("r0")  # before the engine has even taken it from its inbox
    for request in requests[1:]:
        built.submit(request)
    built.step()  # admits two; four wait
    built.cancel("r5")  # queued
    built.cancel("r1")  # prefilled and decoding
    built.run_until_idle()
    assert {i for i, c in finished.items() if c.finish_reason is FinishReason.CANCELLED} == {"r0", "r1", "r5"}
    assert not built.cancel("r3")  # finished: nothing to cancel
    assert_nothing_held(built)


def test_duplicate_ids_in_flight_are_refused(short_dir):
    built = engine(short_dir, lanes=1)
    built.submit(Request(PROMPTS[0], 4, id="same"))
    with pytest.raises(RequestError, match="'same' is already in flight"):
        built.submit(Request(PROMPTS[1], 4, id="same"))
    built.run_until_idle()
    built.generate([Request(PROMPTS[1], 4, id="same")])  # free again once finished


def test_one_driver_at_a_time(short_dir):
    client = EngineClient(engine(short_dir, lanes=1))
    client.start()
    try:
        with pytest.raises(RuntimeError, match="already driven by another thread"):
            client.engine.step()
    finally:
        client.shutdown(0)


def test_the_engine_keeps_nothing_per_finished_request(short_dir):
    built = engine(short_dir, lanes=4)
    for round_ in range(5):
        built.generate([Request(p, 3) for p in PROMPTS[:8]])
    assert not hasattr(built, "completions")
    assert built.stats()["requests_finished"] == {"length": 40} or sum(built.stats()["requests_finished"].values()) == 40
    assert_nothing_held(built)


def test_queue_counts_hold_under_concurrent_submit_and_cancel(short_dir):
    client = EngineClient(engine(short_dir, lanes=2, max_waiting=128))
    client.start()
    try:
        async def one(i):
            handle = client.submit(Request(PROMPTS[i % 16], 6))
            if i % 3 == 0:
                await asyncio.sleep(0.001 * (i % 5))
                handle.cancel()
            return await handle.completion()

        async def many():
            return await asyncio.gather(*(one(i) for i in range(48)))

        results = []
        threads = [threading.Thread(target=lambda: results.extend(asyncio.run(many()))) for _ in range(2)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            client.stats()  # read from another thread while the engine mutates its state
            time.sleep(0.005)
        assert len(results) == 96 and all(r.finish_reason is not None for r in results)
        assert_nothing_held(client.engine)
    finally:
        client.shutdown(0)


# ---- the boundary -----------------------------------------------------------------------


def test_sixteen_async_consumers_equal_their_solo_runs(short_dir, short_drafter_dir, plain):
    client = EngineClient(engine(short_dir, short_drafter_dir, sequences(PROMPTS, plain)))
    client.start()
    try:
        async def consume(i):
            handle = client.submit(Request(PROMPTS[i], 24, draft=i % 3 != 0))
            tokens = []
            async for event in handle:
                tokens += event.token_ids
                last = event
            assert last.completion.token_ids == tokens
            assert last.completion.timings.ttft_seconds > 0
            return tokens

        async def everyone():
            return await asyncio.gather(*(consume(i) for i in range(16)))

        assert asyncio.run(everyone()) == plain
        stats = client.stats()
        assert stats["generation_tokens_total"] == sum(map(len, plain))
        rounds, accepted = scripted_floors([tokens for i, tokens in enumerate(plain) if i % 3 != 0], 10)  # priced: the anchor and a block of 9
        assert stats["drafts_total"] >= rounds and stats["accepted_tokens_total"] >= accepted
    finally:
        client.shutdown(0)
    assert_nothing_held(client.engine)


@pytest.mark.parametrize("when", ["queued", "prefilling", "decoding"])
def test_cancel_frees_everything(when, short_dir, short_drafter_dir, plain):
    long_prompt = [1] + [int(t) for t in np.random.default_rng(9).integers(15, 500, 80)]
    built = engine(short_dir, short_drafter_dir, sequences(PROMPTS, plain), lanes=1, prefill_chunk=16)
    finished = {}
    on_event = lambda e: e.completion and finished.setdefault(e.request_id, e.completion)
    # Decoding, 24 tokens: more than two rounds can emit (a first token, then at most a
    # block of 9), so `first` is still running however the scripted drafts fare.
    if when == "prefilling":
        first = Request(long_prompt, 10, id="first", on_event=on_event)
    else:
        first = Request(PROMPTS[0], 24, id="first", on_event=on_event)
    second = Request(PROMPTS[1], 10, id="second", on_event=on_event)
    built.submit(first)
    built.submit(second)
    built.step()
    built.step()
    target = "second" if when == "queued" else "first"
    assert built.stats()["prefilling" if when == "prefilling" else "running"] >= 1
    built.cancel(target)
    built.run_until_idle()
    assert finished[target].finish_reason is FinishReason.CANCELLED
    other = "first" if target == "second" else "second"
    assert finished[other].finish_reason is not FinishReason.CANCELLED
    assert_nothing_held(built)


def test_a_faulty_round_ends_only_its_lanes_and_the_engine_goes_on(short_dir, plain, monkeypatch):
    client = EngineClient(engine(short_dir, lanes=4))
    run = client.engine.rounds.run
    faults = {"left": 1}

    def faulty(lanes):
        if faults["left"] and any(len(lane.generated) >= 3 for lane in lanes):
            faults["left"] -= 1
            raise RuntimeError("injected fault")
        return run(lanes)

    monkeypatch.setattr(client.engine.rounds, "run", faulty)
    client.start()
    try:
        first = client.generate([Request(PROMPTS[0], 20), Request(PROMPTS[1], 20)])
        assert [c.finish_reason for c in first] == [FinishReason.ERROR] * 2
        assert "injected fault" in first[0].error
        assert client.health().ok
        (after,) = client.generate([Request(PROMPTS[2], 24)])
        assert after.token_ids == plain[2]
    finally:
        client.shutdown(0)


def test_a_faulty_prefill_ends_only_its_lanes(short_dir, plain, monkeypatch):
    built = engine(short_dir, lanes=4, prefill_chunk=4)
    prefill = built.rounds.prefill
    monkeypatch.setattr(built.rounds, "prefill", lambda lanes, chunks: (_ for _ in ()).throw(ValueError("bad chunk"))
                        if any(lane.id == "doomed" for lane in lanes) else prefill(lanes, chunks))
    built.submit(Request(PROMPTS[0], 24, id="fine"))
    finished = {}
    on_event = lambda e: e.completion and finished.setdefault(e.request_id, e.completion)
    built.submit(Request(PROMPTS[0], 24, id="fine2", on_event=on_event))
    built.run_until_idle()
    built.submit(Request(PROMPTS[5], 24, id="doomed", on_event=on_event))
    built.run_until_idle()
    assert finished["doomed"].finish_reason is FinishReason.ERROR and "bad chunk" in finished["doomed"].error
    assert finished["fine2"].token_ids == plain[0]
    assert_nothing_held(built)


def test_a_joining_lanes_first_token_is_read_after_the_others_round_is_launched(short_dir, plain, monkeypatch):
    built = engine(short_dir, lanes=2)
    calls = []
    for name in ("prefill", "run", "first_tokens"):
        real = getattr(built.rounds, name)
        monkeypatch.setattr(built.rounds, name, lambda *args, real=real, name=name: calls.append(name) or real(*args))
    done = {}
    on_event = lambda e: e.completion and done.setdefault(e.request_id, e.completion.token_ids)
    built.submit(Request(PROMPTS[0], 24, id="decoding", on_event=on_event))
    while calls.count("run") < 3:
        built.step()
    built.submit(Request(PROMPTS[1], 24, id="joining", on_event=on_event))
    del calls[:]
    built.step()
    # Its prompt launched, the decoding lane's round launched behind it, then its first token read.
    assert calls == ["prefill", "run", "first_tokens"]
    built.run_until_idle()
    assert [done["decoding"], done["joining"]] == plain[:2]


def test_a_long_prompt_is_launched_at_most_one_chunk_ahead_of_the_host(short_dir, plain, monkeypatch):
    built = engine(short_dir, lanes=2, prefill_chunk=4)
    waits, per_chunk = [], []
    real_eval, real_prefill = mx.eval, built.rounds.prefill

    def counted(lanes, chunks):
        before = len(waits)
        read = real_prefill(lanes, chunks)
        per_chunk.append(len(waits) - before)
        return read

    monkeypatch.setattr(mx, "eval", lambda *arrays: (waits.append(1), real_eval(*arrays))[1])
    monkeypatch.setattr(built.rounds, "prefill", counted)
    (done,) = built.generate([Request(PROMPTS[5], 24)])
    assert done.token_ids == plain[5]
    # Each chunk after the first waits for the one before; the last is waited for as its first token is read.
    assert per_chunk == [0] + [1] * (-(-len(PROMPTS[5]) // 4) - 1)


def test_shutdown_ends_every_lane_with_a_final_event_and_the_client_restarts(short_dir):
    client = EngineClient(engine(short_dir, lanes=2))
    client.start()

    async def run():
        handles = [client.submit(Request(p, 90 - len(p))) for p in PROMPTS[:5]]  # 2 running, 3 waiting
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown, 0.0)
        with pytest.raises(EngineUnavailable):
            client.submit(Request(PROMPTS[0], 4))
        return [await h.completion() for h in handles]

    done = asyncio.run(run())
    assert all(d.finish_reason in (FinishReason.ERROR, FinishReason.LENGTH, FinishReason.STOP) for d in done)
    assert any(d.error == "server shutting down" for d in done)
    assert not client.ready and not client.health().alive
    assert_nothing_held(client.engine)
    client.start()  # a stopped client starts again
    try:
        assert client.wait_ready(10)
        assert client.generate([Request(PROMPTS[0], 3)])[0].finish_reason is not FinishReason.ERROR
    finally:
        client.shutdown(5)


def test_shutdown_lets_running_lanes_finish_within_the_deadline(short_dir, plain):
    client = EngineClient(engine(short_dir, lanes=4))
    client.start()

    async def run():
        handles = [client.submit(Request(p, 24)) for p in PROMPTS[:4]]
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown, 60.0)
        return [await h.completion() for h in handles]

    assert [d.token_ids for d in asyncio.run(run())] == plain[:4]


def test_health_tells_a_stalled_engine_and_a_dead_one(short_dir, monkeypatch):
    client = EngineClient(engine(short_dir, lanes=1), stall_seconds=0.3)
    client.start()
    assert client.wait_ready(10) and client.health().ok
    release = threading.Event()
    run = client.engine.rounds.run
    monkeypatch.setattr(client.engine.rounds, "run", lambda lanes: release.wait(30) and run(lanes))

    async def stalled():
        handle = client.submit(Request(PROMPTS[0], 4))
        await asyncio.sleep(0.8)
        health = client.health()
        release.set()
        await handle.completion()
        return health

    health = asyncio.run(stalled())
    assert health.alive and health.stalled and not health.ok
    assert client.health().ok  # beating again

    # A thread that dies (a bug outside any round's guard) ends every request with an event.
    monkeypatch.setattr(client.engine, "_retire", lambda: (_ for _ in ()).throw(SystemError("engine bug")))

    async def orphaned():
        return await client.submit(Request(PROMPTS[1], 4)).completion()

    done = asyncio.run(orphaned())
    assert done.finish_reason is FinishReason.ERROR and "engine bug" in done.error
    client._thread.join(5)
    assert not client.health().alive and not client.health().ok and "engine bug" in client.health().error
    with pytest.raises(EngineUnavailable, match="engine bug"):
        asyncio.run(orphaned())


def test_logprobs_come_with_their_tokens(short_dir, short_drafter_dir, plain):
    built = engine(short_dir, short_drafter_dir, sequences(PROMPTS, plain), lanes=2, draft_width=5)
    events = []
    done = built.generate([Request(PROMPTS[0], 12, logprobs=3, on_event=events.append), Request(PROMPTS[1], 12)])
    entries = [lp for e in events for lp in (e.logprobs or [])]
    assert [lp.token_id for lp in entries] == done[0].token_ids
    for lp in entries:
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= lp.top[0][1] + 1e-5 and lp.token_id == lp.top[0][0]  # greedy: the best is the token
    with pytest.raises(ValueError, match="logprobs must be within 0..20"):
        Request(PROMPTS[0], 4, logprobs=21)


def test_a_seed_reproduces_a_reply_with_the_real_guards(short_dir, short_drafter_dir, plain):
    request = lambda: Request(PROMPTS[2], 24, SamplingParams(temperature=0.8, seed=42))
    (reference,) = engine(short_dir).generate([request()])
    loaded = open_target(short_dir, max_lanes=1)
    drafter = load_drafter(short_drafter_dir, loaded.target.model, loaded.target.config, max_lanes=1)
    built = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=1))
    built.warm_up()  # guards and costs from this machine's real timings
    for _ in range(3):
        assert built.generate([request()])[0].token_ids == reference.token_ids
    # Whatever the timings, a fresh guard drafts a band's first four rounds (one warm,
    # three explored); how deep they verify is for the measured costs to say.
    assert built.stats()["rounds_by_kind"].get("drafted", 0) >= 4

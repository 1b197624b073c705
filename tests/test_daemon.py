"""The HTTP daemon, served for real on loopback over tiny checkpoints (a dense target with
a DSpark drafter, and an MoE target) and called with the official `openai` client and
raw HTTP: shapes, streaming, logprobs, stops, exactness under concurrency and drafting,
seeds, cancellation on disconnect, every error status, faults, stalls, metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import aiohttp
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.app import ServerConfig
from families.lfm2.tiny_drafter import make_tiny_drafter
from tests.daemon_server import LiveServer, build_serving, http, sse_lines
from tests.priced import fewest_drafted_rounds

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(200 + i).integers(15, 500, 3 + i)] for i in range(16)]
LENGTHS = [6 + (i % 5) for i in range(16)]
CHAT = [{"role": "user", "content": "Explicit is better than implicit."}]


@pytest.fixture(scope="module")
def drafter_dir(dense_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("daemon_drafter"), dense_dir, seed=5, block_size=4)


@pytest.fixture(scope="module")
def dense(dense_dir, drafter_dir):
    """A dense target drafting three tokens every round, 16 lanes."""
    serving, engine = build_serving(dense_dir, drafter_dir, draft_width=4)
    server = LiveServer(serving)
    yield server, engine
    server.close()
    serving.client.shutdown(0)


@pytest.fixture(scope="module")
def one_lane(dense_dir):
    """One lane and one waiting slot, no drafter, and a 0.5 s stall bound."""
    serving, engine = build_serving(dense_dir, streams=1, queue=1, stall_seconds=0.5)
    server = LiveServer(serving)
    yield server, engine
    server.close()
    serving.client.shutdown(0)


def sdk(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


def async_sdk(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def data_events(lines: list[bytes]) -> list:
    """The JSON payloads of `data:` lines, [DONE] excluded."""
    return [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


def scrape(server: LiveServer) -> dict[str, dict]:
    """Metric families by name -> {(sample name, labels): value}."""
    status, _, body = http("GET", server.url + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        out[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return out


def sample(families: dict, family: str, suffix: str = "", **labels) -> float:
    wanted = tuple(sorted({"model_name": "tiny", **labels}.items()))
    return sum(v for (name, lab), v in families[family].items() if name == family + suffix and lab == wanted)


def wait_until(condition, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


# ---- shapes with the official client ---------------------------------------------------


def test_chat_streamed_equals_chat_whole_with_the_openai_client(dense):
    server, _ = dense
    client = sdk(server)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12)
    assert whole.object == "chat.completion" and whole.model == "tiny" and whole.id.startswith("chatcmpl-")
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    timings = whole.model_extra["timings"]
    assert set(timings) == {"queue_seconds", "prompt_seconds", "decode_seconds", "draft_rounds", "draft_proposed",
                            "draft_accepted"}
    assert timings["draft_rounds"] > 0 and timings["decode_seconds"] > 0

    # Text parts render like the same text as a string.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Explicit is better "},
                                          {"type": "text", "text": "than implicit."}]}]
    assert client.chat.completions.create(model="tiny", messages=parts, max_tokens=12).choices[0].message.content \
        == choice.message.content

    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, stream=True))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].model_extra["timings"]["draft_rounds"] > 0


def test_completions_streamed_with_usage_equal_the_whole_reply(dense):
    server, _ = dense
    client = sdk(server)
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10)
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 10
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    *content, usage = chunks
    assert usage.choices == [] and usage.usage == whole.usage
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1

    # The wire: data events, the usage chunk with empty choices, then [DONE].
    async def raw():
        async with aiohttp.ClientSession() as session:
            return await sse_lines(session, server.url + "/v1/completions", {
                "prompt": "The quick brown fox", "max_tokens": 10, "stream": True,
                "stream_options": {"include_usage": True}})

    lines = asyncio.run(raw())
    assert lines[-1] == b"data: [DONE]" and all(line.startswith(b"data: ") for line in lines)
    assert json.loads(lines[-2][6:])["choices"] == [] and "usage" not in json.loads(lines[-3][6:])
    # Token ids, and a list of one prompt, are prompts too.
    ids = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5)
    assert client.completions.create(model="tiny", prompt=[PROMPTS[0]], max_tokens=5).choices[0].text \
        == ids.choices[0].text


def test_continuous_usage_stats_count_tokens_on_every_chunk(dense):
    # vLLM's stream_options.continuous_usage_stats: clients (bench_concurrent) count the
    # tokens each chunk brought without asking for logprobs.
    server, _ = dense
    client = sdk(server)
    whole = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12)
    chunks = list(client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == whole.usage.completion_tokens
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)


def test_logprobs_in_chat_and_completions_shapes(dense):
    server, _ = dense
    client = sdk(server)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy picks the target's argmax, and logprobs are the target's own distribution.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == chat.choices[0].message.content
    streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, logprobs=True,
                                              top_logprobs=3, stream=True)
    streamed_entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed_entries] == [e.token for e in entries]
    assert [e.logprob for e in streamed_entries] == pytest.approx([e.logprob for e in entries], abs=1e-4)

    text = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8, logprobs=2)
    lp, n = text.choices[0].logprobs, text.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n >= 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and 1 <= len(top) <= 3
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8, logprobs=2, stream=True)
    pieces = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    assert [o for p in pieces for o in p.text_offset] == lp.text_offset


def boundary_stop(tokens: list[str], text: str) -> str | None:
    """A stop string made of the end of one token and the start of the next, first seen
    there (None when this reply has none)."""
    if "".join(tokens) != text:  # special tokens show in logprobs, not in text
        return None
    offset = 0
    for left, right in zip(tokens, tokens[1:]):
        offset += len(left)
        candidate = left[-2:] + right[:2]
        if len(candidate) >= 3 and candidate.isprintable() and text.find(candidate) == offset - len(left[-2:]):
            return candidate
    return None


def test_stop_strings_across_token_boundaries_never_leak(dense):
    server, _ = dense
    client = sdk(server)
    for prompt in PROMPTS:
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, logprobs=0)
        text = whole.choices[0].text
        stop = boundary_stop(whole.choices[0].logprobs.tokens, text)
        if stop is not None:
            break
    assert stop is not None
    cut = text.find(stop)
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=[stop, "\x00never"])
    assert stopped.choices[0].text == text[:cut] and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- exactness ---------------------------------------------------------------------------


def test_sixteen_concurrent_streams_equal_their_solo_and_plain_replies(dense):
    server, _ = dense

    async def stream(client, prompt, max_tokens, draft: bool):
        text, timings, usage = "", None, None
        async for chunk in await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, extra_body={"draft": draft},
                stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].text
                timings = chunk.model_extra.get("timings") or timings
            else:
                usage = chunk.usage
        return text, usage.completion_tokens, timings["draft_rounds"]

    def fewest_rounds(replies):  # every round drafts at width 4 but a lane's last (random drafts: no floor on accepts)
        return fewest_drafted_rounds([[0] * tokens for _, tokens, _ in replies], 4)

    async def main():
        client = async_sdk(server)
        solo = [await stream(client, p, n, True) for p, n in zip(PROMPTS, LENGTHS)]
        drafted = await asyncio.gather(*(stream(client, p, n, True) for p, n in zip(PROMPTS, LENGTHS)))
        plain = await asyncio.gather(*(stream(client, p, n, False) for p, n in zip(PROMPTS, LENGTHS)))
        return solo, drafted, plain

    solo, drafted, plain = asyncio.run(main())
    assert [r[:2] for r in drafted] == [r[:2] for r in solo] == [r[:2] for r in plain]
    assert sum(r[2] for r in solo) >= fewest_rounds(solo) and sum(r[2] for r in drafted) >= fewest_rounds(drafted)
    assert all(r[2] == 0 for r in plain)


def test_a_seeded_sampled_reply_repeats_across_runs_and_with_drafting_off(dense):
    server, _ = dense
    client = sdk(server)

    def ask(seed: int, draft: bool = True):
        reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=1.3, top_p=0.95,
                                               seed=seed, extra_body={"draft": draft})
        return reply.choices[0].message.content, reply.model_extra["timings"]["draft_rounds"], reply.usage.completion_tokens

    first, rounds, tokens = ask(1234)
    assert rounds >= fewest_drafted_rounds([[0] * tokens], 4)  # every round at width 4 drafts but a lane's last
    assert ask(1234)[0] == first and ask(1234, draft=False)[:2] == (first, 0)
    assert ask(4321)[0] != first


def test_sampling_defaults_come_from_generation_config(dense_dir, tmp_path):
    checkpoint = tmp_path / "sampled"
    shutil.copytree(dense_dir, checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, "temperature": 1.3, "top_k": 40}))
    serving, _ = build_serving(checkpoint, streams=2)
    server = LiveServer(serving)
    try:
        client = sdk(server)

        def ask(**sampling):
            return client.completions.create(model="tiny", prompt=PROMPTS[9], max_tokens=16, seed=5,
                                             extra_body=sampling).choices[0].text

        assert ask() == ask(temperature=1.3, top_k=40) != ask(temperature=0)
        assert ask(top_k=1) == ask(temperature=0)  # a request field overrides the file's
    finally:
        server.close()
        serving.client.shutdown(0)


# ---- cancellation ------------------------------------------------------------------------


def test_a_client_that_disconnects_is_cancelled_and_the_others_are_unchanged(dense):
    server, engine = dense
    client = sdk(server)
    expected = [client.completions.create(model="tiny", prompt=p, max_tokens=12).choices[0].text for p in PROMPTS[:3]]
    before = scrape(server)
    cancelled_before = engine.stats()["requests_finished"].get("cancelled", 0)

    async def full(session, prompt):
        lines = await sse_lines(session, server.url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "stream": True})
        assert lines[-1] == b"data: [DONE]"
        return "".join(e["choices"][0]["text"] for e in data_events(lines))

    async def leave_early(session):
        async with session.post(server.url + "/v1/completions",
                                json={"prompt": PROMPTS[3], "max_tokens": 3000, "stream": True}) as response:
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data: {")
                if seen == 3:
                    response.close()  # drop the connection mid-stream
                    return

    async def leave_before_the_reply(session):
        with pytest.raises(asyncio.TimeoutError):
            await session.post(server.url + "/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 3000},
                               timeout=aiohttp.ClientTimeout(total=0.3))

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(leave_early(session), leave_before_the_reply(session),
                                        *(full(session, p) for p in PROMPTS[:3]))

    _, _, *texts = asyncio.run(main())
    assert texts == expected
    wait_until(lambda: engine.stats()["in_flight"] == 0 and engine.stats()["running"] == 0)
    assert engine.stats()["requests_finished"]["cancelled"] == cancelled_before + 2
    after = scrape(server)
    name = "laneserve:http_requests_client_disconnected"
    assert sample(after, name, "_total") == sample(before, name, "_total") + 2


# ---- statuses ------------------------------------------------------------------------------


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    got, headers, body = response
    assert got == status, body
    assert headers["Content-Type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code
    return error


def test_each_refusal_has_its_status_and_openai_shape(dense, dense_dir):
    server, _ = dense
    chat, text = server.url + "/v1/chat/completions", server.url + "/v1/completions"
    assert_error(http("POST", chat, data=b'{"messages": [', headers={"Content-Type": "application/json"}), 400)
    assert_error(http("POST", chat, {"messages": "hello"}), 400, "messages")
    assert_error(http("POST", chat, {"messages": [{"role": "user", "content": 5}]}), 400, "messages[0].content")
    assert_error(http("POST", chat, {"messages": CHAT, "max_tokens": "9"}), 400, "max_tokens")
    assert_error(http("POST", chat, {"messages": CHAT, "temperature": -1}), 400, "temperature")
    assert_error(http("POST", chat, {"messages": CHAT, "top_p": 0}), 400, "top_p")
    assert_error(http("POST", chat, {"messages": CHAT, "max_tokens": 0}), 400, "max_tokens")
    assert_error(http("POST", chat, {"messages": CHAT, "n": 2}), 400, "n")
    assert_error(http("POST", chat, {"messages": CHAT, "top_logprobs": 21, "logprobs": True}), 400, "top_logprobs")
    assert_error(http("POST", chat, {"messages": CHAT, "stop": ["x"] * 17}), 400, "stop")
    assert_error(http("POST", chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400,
                 "messages[0].content[0]")
    assert_error(http("POST", text, {"prompt": [1, 99999]}), 400, "prompt")
    assert_error(http("POST", text, {"prompt": ["a", "b"]}), 400, "prompt")
    error = assert_error(http("POST", text, {"prompt": "hi", "max_tokens": 5000}), 400, "max_tokens",
                         "context_length_exceeded")
    assert error["message"].startswith("This model's maximum context length is 4096 tokens; the prompt has ")
    assert error["message"].endswith(" and max_tokens asks for 5000")

    assert_error(http("POST", chat, {"messages": CHAT, "model": "other"}), 404, "model", "model_not_found")
    assert_error(http("POST", chat, {"messages": CHAT, "model": str(dense_dir)}), 404, "model", "model_not_found")
    assert_error(http("GET", server.url + "/v1/nothing"), 404, code="not_found")
    assert_error(http("GET", chat), 405, code="method_not_allowed")
    assert_error(http("POST", chat, data=b"messages=hi", headers={"Content-Type": "application/x-www-form-urlencoded"}),
                 415, code="unsupported_media_type")
    # Unknown fields are ignored.
    status, _, body = http("POST", chat, {"messages": CHAT, "max_tokens": 2, "frobnicate": {"x": 1}, "user": "u"})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] <= 2


def test_a_loading_server_answers_503_but_its_probes_answer(dense):
    loading = LiveServer(None, ServerConfig("tiny"))
    try:
        assert_error(http("POST", loading.url + "/v1/completions", {"prompt": "hi"}), 503, code="loading")
        assert_error(http("GET", loading.url + "/v1/models"), 503, code="loading")
        for path in ("/health", "/ready"):
            status, _, body = http("GET", loading.url + path)
            assert status == 503 and json.loads(body)["status"] == "loading"
        assert http("GET", loading.url + "/metrics")[0] == 200
    finally:
        loading.close()


def test_api_key_and_body_limit(dense):
    server, _ = dense
    guarded = LiveServer(server.serving, ServerConfig("tiny", api_key="sesame", max_body_bytes=4096))
    try:
        chat = guarded.url + "/v1/chat/completions"
        assert_error(http("POST", chat, {"messages": CHAT, "max_tokens": 2}), 401, code="invalid_api_key")
        assert_error(http("POST", chat, {"messages": CHAT, "max_tokens": 2}, headers={"Authorization": "Bearer sesamE"}),
                     401, code="invalid_api_key")
        assert_error(http("GET", guarded.url + "/v1/models", headers={"Authorization": "sesame"}), 401,
                     code="invalid_api_key")
        for path in ("/health", "/ready", "/metrics"):
            assert http("GET", guarded.url + path)[0] == 200
        reply = sdk(guarded, api_key="sesame").chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
        assert reply.usage.completion_tokens <= 2
        key = {"Authorization": "Bearer sesame"}
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error(http("POST", chat, big, headers=key), 413, code="body_too_large")
        # A chunked body past the limit (no Content-Length to refuse it up front).
        async def chunked():
            async def body():
                yield json.dumps(big).encode()

            async with aiohttp.ClientSession() as session:
                async with session.post(chat, data=body(), headers={**key, "Content-Type": "application/json"}) as r:
                    return r.status, dict(r.headers), await r.read()

        assert_error(asyncio.run(chunked()), 413, code="body_too_large")
    finally:
        guarded.close()


def test_a_full_queue_answers_429_with_retry_after(one_lane):
    server, engine = one_lane

    async def main():
        async with aiohttp.ClientSession() as session:
            url = server.url + "/v1/completions"
            running = await session.post(url, json={"prompt": PROMPTS[0], "max_tokens": 3000, "stream": True})
            await running.content.readline()
            await asyncio.to_thread(wait_until, lambda: engine.stats()["running"] == 1)
            waiting = asyncio.create_task(session.post(url, json={"prompt": PROMPTS[1], "max_tokens": 3000}))
            await asyncio.to_thread(wait_until, lambda: engine.stats()["queue_depth"] == 1)
            async with session.post(url, json={"prompt": PROMPTS[2], "max_tokens": 4}) as refused:
                result = refused.status, dict(refused.headers), await refused.read()
            running.close()
            waiting.cancel()
            return result

    status = asyncio.run(main())
    assert_error(status, 429, code="queue_full")
    assert status[1]["Retry-After"] == "1"
    wait_until(lambda: engine.stats()["in_flight"] == 0)


# ---- faults, stalls, keepalive -------------------------------------------------------------


def test_an_engine_fault_ends_its_streams_with_an_error_event_and_the_server_goes_on(dense, monkeypatch):
    server, engine = dense
    client = sdk(server)
    expected = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=12).choices[0].text
    real, calls = engine.rounds.run, []

    def faulty(lanes, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real(lanes, *args, **kwargs)

    monkeypatch.setattr(engine.rounds, "run", faulty)

    async def main():
        async with aiohttp.ClientSession() as session:
            return await sse_lines(session, server.url + "/v1/completions",
                                   {"prompt": PROMPTS[5], "max_tokens": 40, "stream": True})

    lines = asyncio.run(main())
    monkeypatch.undo()
    assert lines[-1] == b"data: [DONE]"
    error = data_events(lines)[-1]["error"]
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    assert http("GET", server.url + "/health")[0] == 200
    assert client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=12).choices[0].text == expected


def test_a_stalled_engine_turns_health_503(one_lane, monkeypatch):
    server, engine = one_lane
    real, release = engine.rounds.run, threading.Event()

    def stuck(lanes, *args, **kwargs):
        release.wait(10)
        return real(lanes, *args, **kwargs)

    monkeypatch.setattr(engine.rounds, "run", stuck)
    asking = threading.Thread(target=http, args=("POST", server.url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3}))
    asking.start()
    wait_until(lambda: http("GET", server.url + "/health")[0] == 503, 5)
    status, _, body = http("GET", server.url + "/health")
    assert json.loads(body)["status"] == "stalled" and http("GET", server.url + "/ready")[0] == 503
    release.set()
    asking.join(10)
    wait_until(lambda: http("GET", server.url + "/health")[0] == 200, 5)


def test_a_dead_engine_thread_turns_health_503_and_ends_its_streams(dense_dir, monkeypatch):
    serving, engine = build_serving(dense_dir, streams=2)
    server = LiveServer(serving)

    def die(lanes, *args, **kwargs):
        raise SystemExit("the engine thread is gone")  # not an Exception: no round may catch it

    monkeypatch.setattr(engine.rounds, "run", die)
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                return await sse_lines(session, server.url + "/v1/completions",
                                       {"prompt": PROMPTS[0], "max_tokens": 8, "stream": True})

        lines = asyncio.run(main())
        assert lines[-1] == b"data: [DONE]" and "error" in data_events(lines)[-1]
        wait_until(lambda: not serving.client.health().alive, 5)  # its last act was ending the streams
        status, _, body = http("GET", server.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "dead" and "SystemExit" in json.loads(body)["error"]
        assert http("GET", server.url + "/ready")[0] == 503
        assert_error(http("POST", server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 503,
                     code="engine_unavailable")
    finally:
        server.close()
        serving.client.shutdown(0)


def test_keepalive_comments_while_a_long_prompt_is_read(one_lane, monkeypatch):
    server, engine = one_lane
    patient = LiveServer(server.serving, ServerConfig("tiny", keepalive_seconds=0.05))
    real = engine.rounds.prefill

    def slow_prefill(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.rounds, "prefill", slow_prefill)
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                return await sse_lines(session, patient.url + "/v1/completions",
                                       {"prompt": PROMPTS[6], "max_tokens": 3, "stream": True})

        lines = asyncio.run(main())
    finally:
        patient.close()
    first_text = next(i for i, line in enumerate(lines) if line.startswith(b"data: {"))
    assert b": keepalive" in lines[:first_text] and lines[-1] == b"data: [DONE]"


# ---- metrics and the small endpoints -------------------------------------------------------


VLLM_NAMES = [
    "num_requests_running", "num_requests_waiting", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_prompt_tokens", "request_generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
]
OWN_NAMES = ["prompt_lookup_num_drafts", "rounds", "round_mode_rounds", "round_mode_seconds", "round_mode_tokens", "round_seconds", "verify_rows", "guard_drafting", "guard_tokens_per_second", "kv_bytes_in_use",
             "http_requests_client_disconnected"]


def test_metrics_parse_and_count_what_was_served(dense):
    server, engine = dense
    before = scrape(server)
    assert {"laneserve:" + n for n in VLLM_NAMES + OWN_NAMES} <= set(before)
    reply = sdk(server).completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=9)
    wait_until(lambda: engine.stats()["running"] == 0)  # the lane retires just after its last event
    after = scrape(server)

    def delta(family, suffix="", **labels):
        return sample(after, "laneserve:" + family, suffix, **labels) - sample(before, "laneserve:" + family, suffix, **labels)

    assert delta("prompt_tokens", "_total") == reply.usage.prompt_tokens == len(PROMPTS[7])
    assert delta("generation_tokens", "_total") == reply.usage.completion_tokens
    assert delta("request_success", "_total", finished_reason=reply.choices[0].finish_reason) == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert delta(histogram, "_count") == 1
    assert delta("request_generation_tokens", "_sum") == reply.usage.completion_tokens
    assert delta("inter_token_latency_seconds", "_count") == reply.usage.completion_tokens - 1
    assert delta("rounds", "_total", kind="drafted") > 0 and delta("spec_decode_num_draft_tokens", "_total") > 0
    assert sample(after, "laneserve:num_requests_running") == 0
    assert sample(after, "laneserve:round_seconds", "_count") == sum(
        v for (name, _), v in after["laneserve:rounds"].items() if name == "laneserve:rounds_total")
    # Every token but the first (the prompt's read gives it) came from a drafted or a plain round.
    by_mode = {mode: delta("round_mode_tokens", "_total", mode=mode) for mode in ("drafted", "plain")}
    assert by_mode["drafted"] > 0 and sum(by_mode.values()) == reply.usage.completion_tokens - 1
    seconds = sum(delta("round_mode_seconds", "_total", mode=mode) for mode in ("drafted", "plain"))
    assert seconds == pytest.approx(delta("round_seconds", "_sum"))
    rounds = {mode: delta("round_mode_rounds", "_total", mode=mode) for mode in ("drafted", "plain")}
    assert rounds["drafted"] > 0 and sum(rounds.values()) == delta("round_seconds", "_count")


def test_models_tokenize_detokenize_version_and_probes(dense):
    server, _ = dense
    status, _, body = http("GET", server.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    assert [m.id for m in sdk(server).models.list()] == ["tiny"]
    status, _, body = http("POST", server.url + "/tokenize", {"prompt": "The quick brown fox"})
    tokens = json.loads(body)
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 4096
    status, _, body = http("POST", server.url + "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == "The quick brown fox"
    status, _, body = http("POST", server.url + "/tokenize", {"messages": CHAT})
    chat = sdk(server).chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert json.loads(body)["count"] == chat.usage.prompt_tokens
    assert_error(http("POST", server.url + "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(http("POST", server.url + "/tokenize", {}), 400, "prompt")
    status, _, body = http("GET", server.url + "/version")
    assert status == 200 and json.loads(body)["version"]
    assert json.loads(http("GET", server.url + "/health")[2])["status"] == "ok"
    assert json.loads(http("GET", server.url + "/ready")[2])["status"] == "ready"


def test_an_moe_target_serves_chat_and_completions(moe_dir):
    serving, _ = build_serving(moe_dir, streams=4)
    server = LiveServer(serving)
    try:
        client = sdk(server)
        whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
        streamed = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
        text = client.completions.create(model="tiny", prompt=PROMPTS[8], max_tokens=8)
        assert text.usage.completion_tokens > 0 and text.choices[0].finish_reason in ("stop", "length")
    finally:
        server.close()
        serving.client.shutdown(0)

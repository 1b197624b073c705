"""bench_concurrent and bench.exact: their arithmetic, and both end to end against a real
laneserve server on a tiny checkpoint."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily

from bench.concurrent_report import summarize
from bench.openai_stream import ChunkReader, RequestSpec, Sampling, SseDecoder, StreamResult
from bench.serving_metrics import (
    RequestRecord,
    StreamEvent,
    cell_metrics,
    counter_deltas,
    distribution,
    parse_counters,
    rounds_by_kind,
    spec_decode_metrics,
    token_latencies,
    tpot,
)

# ---- latencies ----------------------------------------------------------------------------


def test_an_event_of_k_tokens_gives_k_latencies_of_its_gap_over_k():
    events = [StreamEvent(1.0, 1), StreamEvent(1.5, 1), StreamEvent(2.1, 3), StreamEvent(2.2, 1)]
    ttft, itls = token_latencies(0.5, events)
    assert ttft == pytest.approx(0.5)
    assert itls == pytest.approx([0.5, 0.2, 0.2, 0.2, 0.1])
    assert sum(itls) == pytest.approx(2.2 - 1.0)  # the decode time, whatever the split


def test_tokens_that_come_with_the_first_get_zero_latency_and_empty_events_are_skipped():
    events = [StreamEvent(0.3, 0), StreamEvent(1.0, 2), StreamEvent(1.2, 0), StreamEvent(1.6, 2)]
    ttft, itls = token_latencies(0.0, events)
    assert ttft == pytest.approx(1.0)
    assert itls == pytest.approx([0.0, 0.3, 0.3])


def test_tpot_uses_the_servers_token_count():
    record = RequestRecord(sent=0.0, ended=2.0, status=200, events=[StreamEvent(0.5, 1), StreamEvent(1.9, 5)], usage_tokens=7)
    assert tpot(record) == pytest.approx((2.0 - 0.5) / 6)
    assert token_latencies(0.0, []) == (None, [])


def test_distribution_uses_linear_percentiles_in_ms():
    d = distribution("itl", [1.0, 2.0, 3.0, 4.0, 5.0])
    assert d["mean_itl_ms"] == pytest.approx(3000)
    assert d["median_itl_ms"] == pytest.approx(3000)
    assert d["std_itl_ms"] == pytest.approx(1000 * math.sqrt(2))
    assert d["p90_itl_ms"] == pytest.approx(4600)
    assert d["p99_itl_ms"] == pytest.approx(4960)
    assert set(distribution("ttft", []).values()) == {None}


def test_a_cell_counts_what_arrived_while_its_streams_were_full():
    # Two streams from t=10: measured requests end at 11 and 13; a filler started at 11
    # keeps the streams full until 13 and ends at 14, after the window.
    a = RequestRecord(10.0, 11.0, 200, [StreamEvent(10.2, 1), StreamEvent(10.6, 2), StreamEvent(11.0, 1)], usage_tokens=4, prompt_tokens=5)
    b = RequestRecord(10.0, 13.0, 200, [StreamEvent(10.5, 1), StreamEvent(13.0, 3)], usage_tokens=4, prompt_tokens=6)
    filler = RequestRecord(11.0, 14.0, 200, [StreamEvent(11.5, 2), StreamEvent(14.0, 2)], usage_tokens=4, measured=False)
    refused = RequestRecord(11.0, 11.0, 429, error="queue full")
    m = cell_metrics([a, b, filler, refused], streams=2, start=10.0)
    assert m["duration"] == pytest.approx(3.0)
    assert m["total_output_tokens"] == 4 + 4 + 2  # the filler's last 2 tokens came after the window
    assert m["output_throughput"] == pytest.approx(10 / 3)
    assert m["per_stream_output_throughput"] == pytest.approx(10 / 6)
    assert m["request_throughput"] == pytest.approx(2 / 3)
    assert m["total_input_tokens"] == 11
    assert (m["completed"], m["failed"], m["failures"]) == (2, 1, {"429": 1})
    assert m["mean_ttft_ms"] == pytest.approx(350)
    assert m["mean_e2el_ms"] == pytest.approx(2000)
    assert m["max_concurrency"] == 2


# ---- /metrics ---------------------------------------------------------------------------


def exposition(drafts, draft_tokens, accepted, per_position, rounds, looked_up=None) -> str:
    """A /metrics page as laneserve's (with `looked_up`, its prompt-lookup counter) or vLLM's."""
    registry = CollectorRegistry()

    class Collector:
        def collect(self):
            def counter(name, value, labels=None):
                family = CounterMetricFamily("laneserve:" + name, name, labels=["model_name", *(labels or {})])
                family.add_metric(["m", *(labels or {}).values()], value)
                return family

            yield counter("spec_decode_num_drafts", drafts)
            if looked_up is not None:
                yield counter("prompt_lookup_num_drafts", looked_up)
            yield counter("spec_decode_num_draft_tokens", draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", accepted)
            per_pos = CounterMetricFamily("laneserve:spec_decode_num_accepted_tokens_per_pos", "p", labels=["model_name", "position"])
            for position, value in enumerate(per_position):
                per_pos.add_metric(["m", str(position)], value)
            yield per_pos
            kinds = CounterMetricFamily("laneserve:rounds", "r", labels=["model_name", "kind"])
            for kind, value in rounds.items():
                kinds.add_metric(["m", kind], value)
            yield kinds

    registry.register(Collector())
    return generate_latest(registry).decode()


def test_metric_deltas_give_vllms_speculative_figures():
    before = parse_counters(exposition(10, 90, 30, [9, 8, 7], {"plain": 100, "drafted": 10}, looked_up=6))
    after = parse_counters(exposition(14, 126, 48, [13, 11, 9], {"plain": 130, "drafted": 14, "probe": 2}, looked_up=7))
    deltas = counter_deltas(before, after)
    spec = spec_decode_metrics(deltas)
    assert spec["spec_decode_num_drafts"] == 4
    assert spec["spec_decode_draft_tokens"] == 36
    assert spec["spec_decode_accepted_tokens"] == 18
    assert spec["spec_decode_acceptance_rate"] == pytest.approx(50.0)  # percent, as vLLM's bench
    assert spec["spec_decode_acceptance_length"] == pytest.approx(1 + 18 / 4)
    assert spec["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.75, 0.5])
    assert spec["prompt_lookup_share"] == pytest.approx(1 / 4)  # of the cell's drafts, not the counter's total
    assert rounds_by_kind(deltas) == {"plain": 30, "drafted": 4, "probe": 2}


def test_a_cell_without_drafts_or_counters_has_no_acceptance():
    same = parse_counters(exposition(5, 45, 20, [5], {"plain": 7}, looked_up=2))
    spec = spec_decode_metrics(counter_deltas(same, same))
    assert spec["spec_decode_num_drafts"] == 0
    assert spec["spec_decode_acceptance_rate"] is None and spec["spec_decode_per_position_acceptance_rates"] is None
    assert spec["prompt_lookup_share"] is None  # a server without the counter (vLLM) and one that drafted nothing alike
    assert set(spec_decode_metrics({}).values()) == {None}


# ---- SSE and token counts ---------------------------------------------------------------------


def test_sse_events_split_across_reads_comments_and_crlf():
    decoder = SseDecoder()
    assert decoder.feed(b": keepalive\n\ndata: {\"a\"") == []
    assert decoder.feed(b": 1}\r\n\r\ndata: [DONE]\n") == ['{"a": 1}']
    assert decoder.feed(b"\n") == ["[DONE]"]


def chunk(text="", usage=None, logprobs=None, finish=None, choices=True):
    body = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish, "logprobs": logprobs}] if choices else []}
    if usage is not None:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": usage, "total_tokens": 3 + usage}
    return body


def read(chunks) -> StreamResult:
    result = StreamResult(RequestRecord(0.0, 0.0, 200))
    reader = ChunkReader(result)
    for t, c in enumerate(chunks, 1):
        reader.add(c, float(t))
    return result


def test_tokens_per_chunk_come_from_usage_growth_first():
    r = read([chunk("ab", usage=1), chunk("cdef", usage=4), chunk("", usage=5, finish="length"), chunk(usage=5, choices=False)])
    assert [(e.time, e.tokens) for e in r.record.events] == [(1.0, 1), (2.0, 3), (3.0, 1)]
    assert r.record.output_tokens == 5 and r.record.prompt_tokens == 3
    assert (r.text, r.finish_reason) == ("abcdef", "length")


def test_tokens_per_chunk_from_logprobs_entries_else_one_per_text_chunk():
    entries = {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []},
                           {"token": "b", "logprob": -0.2, "bytes": [98], "top_logprobs": []}]}
    r = read([chunk("ab", logprobs=entries), chunk("c"), chunk("", finish="stop"), chunk(usage=4, choices=False)])
    assert [e.tokens for e in r.record.events] == [2, 1]
    assert r.record.output_tokens == 4  # the final usage chunk is the server's word
    assert [t.identity for t in r.logprobs] == [(97,), (98,)]


def test_a_mid_stream_error_event_fails_the_request():
    r = read([chunk("a"), {"error": {"message": "engine fault", "type": "server_error"}}])
    assert not r.record.ok and r.record.error == "engine fault" and r.record.failure == "stream-error"


def test_request_bodies_send_draft_seed_and_logprobs_only_when_asked():
    plain = RequestSpec("hi", 8).body()
    assert "draft" not in plain and "seed" not in plain and "logprobs" not in plain and "model" not in plain
    assert plain["stream_options"]["include_usage"]
    chat = RequestSpec("hi", 8, Sampling(0.7, 3), draft=False, top_logprobs=2).body()
    assert (chat["draft"], chat["seed"], chat["logprobs"], chat["top_logprobs"]) == (False, 3, True, 2)
    text = RequestSpec("hi", 8, Sampling(0.0, 3), endpoint="completions", top_logprobs=0).body()
    assert text["prompt"] == "hi" and text["logprobs"] == 0 and "seed" not in text


def test_spread_replies_draw_each_requests_max_tokens_the_same_in_every_cell():
    import argparse

    from bench.bench_concurrent import Runner, Server, Setting, main, max_tokens_range

    assert max_tokens_range(128, 0.0) == (128, 128) and max_tokens_range(128, 0.5) == (64, 192)
    assert max_tokens_range(2, 0.9) == (1, 4)
    args = argparse.Namespace(distinct=True, temperature=0.0, seed=0, max_tokens=100, max_tokens_spread=0.5,
                              endpoint="chat", model=None)
    runner = Runner(args, None, ["a", "b"])
    setting = Setting(Server("s", "http://x", True, True, "usage"), True)
    draws = [runner.spec(k, setting).max_tokens for k in range(200)]
    assert all(50 <= n <= 150 for n in draws) and len(set(draws)) > 50
    assert draws == [runner.spec(k, Setting(setting.server, False)).max_tokens for k in range(200)]  # same in every cell
    assert {runner.spec(k, setting, longest=True).max_tokens for k in range(5)} == {150}  # priming records replies whole
    args.max_tokens_spread = 0.0
    assert {runner.spec(k, setting).max_tokens for k in range(20)} == {100}
    with pytest.raises(SystemExit):
        main(["--url", "http://127.0.0.1:9", "--max-tokens-spread", "1.5"])


# ---- the report -------------------------------------------------------------------------------


def test_ratios_are_taken_per_round_then_summarized():
    def cell(setting, round_, tok_s):
        return {"setting": setting, "server": setting.split()[0], "draft": None, "streams": 4, "round": round_,
                "output_throughput": tok_s, "failures": {}}

    cells = [cell("a", 1, 100.0), cell("b", 1, 150.0), cell("a", 2, 50.0), cell("b", 2, 100.0), cell("a", 3, 80.0), cell("b", 3, 200.0)]
    (a, b) = summarize(cells, "a")
    assert a["output_throughput"] == {"median": 80.0, "min": 50.0, "max": 100.0}
    assert b["output_throughput_ratio"] == {"median": 2.0, "min": 1.5, "max": 2.5}
    assert a["output_throughput_ratio"]["median"] == 1.0
    assert json.loads(json.dumps(b))["rounds"] == 3


def test_exact_names_the_first_differing_token_and_the_top2_margin_there():
    from bench.exact import compare
    from bench.openai_stream import TokenLogprob

    def reply(tokens, finish="length"):
        r = StreamResult(RequestRecord(0.0, 1.0, 200), "".join(tokens), finish)
        r.logprobs = [TokenLogprob(t, -0.5, [(t, -0.5), ("z", -0.7)], tuple(t.encode())) for t in tokens]
        return r

    reference = reply(["a", "b", "c"])
    assert compare("greedy", 0, "solo draft on", reply(["a", "b", "c"]), reference) is None
    m = compare("greedy", 2, "concurrent draft on", reply(["a", "x", "c"]), reference)
    assert (m.position, m.reply, m.reference) == (1, "x", "b")
    assert m.margin == pytest.approx(0.2) and m.reference_margin == pytest.approx(0.2)
    shorter = compare("seeded", 1, "concurrent draft off", reply(["a", "b"], "stop"), reference)
    assert (shorter.position, shorter.reply, shorter.margin) == (2, "<end>", None)
    assert compare("greedy", 0, "solo draft on", reply(["a", "b", "c"], "stop"), reference).position == 3


# ---- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_server(dense_dir, tmp_path_factory):
    """bench.serve_scripted (laneserve's own `serve`, scripted drafter) on a free port,
    drafting 2 proposals every round so that drafted rounds happen on any machine."""
    import re
    import subprocess
    import sys
    import time

    from families.lfm2.tiny_drafter import make_tiny_drafter

    tmp = tmp_path_factory.mktemp("scripted")
    drafter = make_tiny_drafter(tmp / "drafter", dense_dir, seed=3)
    log = tmp / "serve.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.serve_scripted", "--model", str(dense_dir), "--draft-model", str(drafter),
             "--port", "0", "--max-streams", "2", "--draft-width", "3"],
            stdout=sink, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"serving on (http://\S+)", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(30)


def test_bench_concurrent_end_to_end(scripted_server, tmp_path):
    from bench.bench_concurrent import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me about the sea.\nName three colours.\nWhat is a lane?\n")
    out = tmp_path / "out"
    main(["--url", f"laneserve={scripted_server}", "--streams", "1,2", "--min-seconds", "1", "--rounds", "1",
          "--max-tokens", "6", "--max-tokens-spread", "0.5", "--prompts", str(prompts), "--out", str(out)])
    result = json.loads((out / "bench_concurrent.json").read_text())
    assert result["max_tokens_spread"] == 0.5
    assert result["servers"][0]["drafting"] and result["settings"] == ["laneserve draft off", "laneserve draft on"]
    cells = {(c["draft"], c["streams"]): c for c in result["cells"]}
    assert set(cells) == {(False, 1), (True, 1), (False, 2), (True, 2)}
    keys = ["request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
            "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "spec_decode_acceptance_rate",
            "spec_decode_acceptance_length", "spec_decode_per_position_acceptance_rates"]
    for cell in cells.values():
        assert all(k in cell for k in keys)
        assert cell["completed"] > 0 and cell["failed"] == 0 and cell["duration"] >= 1
        assert cell["output_throughput"] > 0 and cell["mean_itl_ms"] > 0
    for streams in (1, 2):
        drafted, plain = cells[(True, streams)], cells[(False, streams)]
        assert plain["spec_decode_num_drafts"] == 0 and plain["spec_decode_acceptance_rate"] is None
        assert drafted["spec_decode_num_drafts"] > 0 and 0 < drafted["spec_decode_acceptance_rate"] <= 100
        assert len(drafted["spec_decode_per_position_acceptance_rates"]) == 2  # --draft-width 3: two drafts a round
        assert drafted["rounds_by_kind"]["drafted"] > 0
        assert 0 <= drafted["prompt_lookup_share"] <= 1 and plain["prompt_lookup_share"] is None
    assert len(result["summary"]) == 4
    assert "| laneserve draft on | 2 |" in (out / "bench_concurrent.md").read_text()
    assert "max_tokens 6 x (1 -/+ 0.5), drawn per request" in (out / "bench_concurrent.md").read_text()
    assert (out / "bench_concurrent.png").read_bytes().startswith(b"\x89PNG")


def test_exact_end_to_end(scripted_server, tmp_path, capsys):
    from bench.exact import main

    report = tmp_path / "exact.json"
    assert main(["--url", scripted_server, "--streams", "2", "--max-tokens", "8", "--out", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["compared"] == 2 * 3 * 2 and result["mismatches"] == [] and result["logprobs"]
    assert result["spec_decode"]["spec_decode_num_drafts"] > 0  # drafted rounds were checked
    assert "exact: 12/12" in capsys.readouterr().out

"""Prometheus metrics in vLLM's vocabulary, under a `laneserve:` prefix.

Per-request histograms (latencies, token counts) are fed from each request's lane
events on the daemon's loop; engine totals (requests, tokens, rounds, drafts, guards,
KV bytes, prefix cache) are read from `EngineClient.stats()` at scrape time by a
collector, so they are never counted twice and never drift from the engine's own numbers.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from lanes.lane import Completion, LaneEvent

PREFIX = "laneserve:"

# What `stats()["prefix_cache"]` would say of a cache that is off: every series stays
# present at zero, so dashboards and rate() need no special case for it.
NO_PREFIX_CACHE = {"budget_bytes": 0, "bytes": 0, "queried_tokens_total": 0, "hit_tokens_total": 0}

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
VERIFY_ROWS_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]


def buckets_1_2_5(limit: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(value)
        exponent += 1


def cumulative(counts: dict[int, int], edges: list[int]) -> list[tuple[str, int]]:
    """A {value: count} tally as Prometheus buckets: (le, observations <= le), then +Inf."""
    buckets = [(str(edge), sum(c for v, c in counts.items() if v <= edge)) for edge in edges]
    return buckets + [("+Inf", sum(counts.values()))]


class Metrics:
    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Seconds from arrival to the first token.", TTFT_BUCKETS)
        self.inter_token = histogram(
            "inter_token_latency_seconds",
            "Seconds between tokens of a stream: a round's interval divided over the tokens it gave that stream.",
            ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Seconds waiting for a lane.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Seconds from admission to the first token.",
                                 REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Seconds from the first token to the last.",
                                REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.", token_buckets)
        self.client_disconnected = Counter(
            PREFIX + "http_requests_client_disconnected", "Requests whose client went away before the reply ended.",
            ["model_name"], registry=self.registry,
        ).labels(model_name)
        self.registry.register(EngineCollector(model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def observe_completion(self, completion: Completion) -> None:
        t = completion.timings
        if t.first_token is not None:
            self.ttft.observe(t.ttft_seconds)
            self.prefill.observe(t.prefill_seconds)
            self.decode.observe(t.decode_seconds)
        if t.admitted is not None:
            self.queue.observe(t.queue_seconds)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.submitted)
        self.prompt_tokens.observe(completion.prompt_tokens)
        self.generation_tokens.observe(len(completion.token_ids))


class RequestTracker:
    """One request's events as they arrive: inter-token latencies, then its completion."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.completion: Completion | None = None
        self._last_tokens_at: float | None = None

    def observe(self, event: LaneEvent) -> None:
        if event.token_ids:
            if self._last_tokens_at is not None:
                gap = (event.time - self._last_tokens_at) / len(event.token_ids)
                for _ in event.token_ids:
                    self.metrics.inter_token.observe(gap)
            self._last_tokens_at = event.time
        if event.completion is not None:
            self.completion = event.completion
            self.metrics.observe_completion(event.completion)


class EngineCollector:
    """The engine's running totals, read from one `stats()` snapshot per scrape."""

    def __init__(self, model_name: str, stats: Callable[[], dict]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        m = self.model_name

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([m], value)
            return family

        def by(name: str, doc: str, label: str, values: dict, family=CounterMetricFamily):
            out = family(PREFIX + name, doc, labels=["model_name", label])
            for key, value in sorted(values.items()):
                out.add_metric([m, str(key)], value)
            return out

        yield gauge("num_requests_running", "Requests in lanes (prefilling or decoding).", s["running"])
        yield gauge("num_requests_waiting", "Requests submitted and waiting for a lane.", s["queue_depth"])
        yield counter("prompt_tokens", "Prompt tokens read.", s["prompt_tokens_total"])
        yield counter("generation_tokens", "Tokens generated.", s["generation_tokens_total"])
        yield by("request_success", "Finished requests by finish reason.", "finished_reason", s["requests_finished"])

        yield counter("spec_decode_num_drafts", "Lane-rounds that verified at least one draft.", s["drafts_total"])
        yield counter("prompt_lookup_num_drafts", "Lane-rounds whose verified drafts were copied by prompt lookup "
                      "(counted in spec_decode_num_drafts too).", s["looked_up_drafts_total"])
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s["draft_tokens_total"])
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["accepted_tokens_total"])
        yield by("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the block.",
                 "position", dict(enumerate(s["accepted_per_position"])))

        yield by("rounds", "Engine rounds by kind.", "kind", s["rounds_by_kind"])
        # Drafting's cost or gain against plain rounds of the same engine: tokens / seconds by mode.
        yield by("round_mode_rounds", "Engine rounds that drafted and plain ones.", "mode", s["rounds_by_mode"])
        yield by("round_mode_seconds", "Seconds of engine rounds that drafted and of plain ones.", "mode", s["seconds_by_mode"])
        yield by("round_mode_tokens", "Tokens emitted by engine rounds that drafted and by plain ones.", "mode", s["emitted_by_mode"])
        rounds = HistogramMetricFamily(PREFIX + "round_seconds", "Seconds per engine round.", labels=["model_name"])
        seconds = s["round_seconds"]
        buckets = [(str(le), count) for le, count in seconds["buckets"] if le != float("inf")]
        rounds.add_metric([m], buckets + [("+Inf", seconds["count"])], seconds["sum"])
        yield rounds
        rows = HistogramMetricFamily(PREFIX + "verify_rows", "Target rows verified per round.", labels=["model_name"])
        verify = {int(k): v for k, v in s["verify_rows"].items()}
        rows.add_metric([m], cumulative(verify, VERIFY_ROWS_BUCKETS), sum(k * v for k, v in verify.items()))
        yield rows

        yield by("guard_drafting", "1 where the guard drafts in this (lanes, context) band, else 0.", "band",
                 s["guard_drafting"], GaugeMetricFamily)
        speed = GaugeMetricFamily(PREFIX + "guard_tokens_per_second",
                                  "Realised tokens per second of round time, per band and choice; a round's tokens "
                                  "counted at the band's smallest lane count (plain rounds of L lanes weighed against "
                                  "plain rounds of that many).",
                                  labels=["model_name", "band", "choice"])
        for band, entry in sorted(s["guard"].items()):
            for choice in ("drafted", "plain"):
                if entry.get(f"{choice}_tps") is not None:
                    speed.add_metric([m, band, choice], entry[f"{choice}_tps"])
        yield speed
        yield gauge("kv_bytes_in_use", "Bytes of KV and drafter caches held by running lanes.", s["kv_bytes_in_use"])
        yield gauge("kv_bytes_reserved", "Bytes of KV and drafter cache pools allocated.", s["kv_bytes_reserved"])

        # vLLM's names: hit rate = hits / queries, both in prompt tokens.
        cache = s.get("prefix_cache", NO_PREFIX_CACHE)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache["queried_tokens_total"])
        yield counter("prefix_cache_hits", "Prompt tokens restored from the prefix cache.", cache["hit_tokens_total"])
        yield gauge("prefix_cache_bytes", "Bytes the prefix cache's blocks hold.", cache["bytes"])
        yield gauge("prefix_cache_budget_bytes", "Most bytes the prefix cache may hold (0: off).", cache["budget_bytes"])

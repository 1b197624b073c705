"""The arithmetic of a load run over HTTP: per-request latencies, a cell's figures under
`vllm bench serve`'s key names, and deltas of a server's Prometheus counters.

Pure functions over plain values, so every number a benchmark prints is unit-tested.
Times are seconds on one monotonic clock; figures reported in ms say so in their key.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


@dataclass
class StreamEvent:
    """One SSE chunk that brought tokens: when it arrived and how many it brought."""

    time: float
    tokens: int


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    sent: float
    ended: float
    status: int  # HTTP status; 0 when the connection failed
    events: list[StreamEvent] = field(default_factory=list)
    usage_tokens: int | None = None  # completion_tokens of the final usage chunk, when sent
    prompt_tokens: int | None = None
    error: str | None = None  # a non-200 body, a mid-stream error event, or a connection error
    measured: bool = True  # False for the requests that only keep the streams full after a cell's time

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def output_tokens(self) -> int:
        """The server's own count when it reports usage, else the tokens the events brought."""
        return self.usage_tokens if self.usage_tokens is not None else sum(e.tokens for e in self.events)

    @property
    def failure(self) -> str:
        """How the request failed, as a key of a cell's failure counts."""
        if self.status == 0:
            return "connection"
        return str(self.status) if self.status != 200 else "stream-error"


def token_latencies(sent: float, events: Sequence[StreamEvent]) -> tuple[float | None, list[float]]:
    """TTFT and the inter-token latencies of one request.

    An event that brings k tokens after a gap g gives k latencies of g / k: a drafted
    round delivers several tokens at once, and splitting its gap keeps one latency per
    token, so the latencies sum to the decode time and their mean is the TPOT. Tokens
    that arrive with the first token get latency 0. Events without tokens are skipped
    (their gap counts toward the next event that brings some)."""
    bearing = [e for e in events if e.tokens > 0]
    if not bearing:
        return None, []
    first = bearing[0]
    itls = [0.0] * (first.tokens - 1)
    for before, event in itertools.pairwise(bearing):
        itls += [(event.time - before.time) / event.tokens] * event.tokens
    return first.time - sent, itls


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (e2el - ttft) / (tokens - 1), as vLLM's bench."""
    ttft, _ = token_latencies(record.sent, record.events)
    if ttft is None or record.output_tokens < 2:
        return None
    return (record.ended - record.sent - ttft) / (record.output_tokens - 1)


def distribution(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and percentiles of latencies in ms, under vLLM's keys
    (percentiles by linear interpolation, numpy's default, as vLLM)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms", *(f"p{p}_{name}_ms" for p in PERCENTILES)]
    if not seconds:
        return dict.fromkeys(keys)
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    values = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES)]
    return {k: float(v) for k, v in zip(keys, values)}


def cell_metrics(records: Sequence[RequestRecord], streams: int, start: float) -> dict:
    """A cell's figures. The cell's window runs from `start` to the end of its last
    measured request; the streams were full all along (requests that only fill them,
    `measured=False`, ran until then). Throughput counts every token and completion that
    arrived inside the window; latencies come from the measured requests that succeeded."""
    measured = [r for r in records if r.measured]
    done = [r for r in measured if r.ok]
    end = max((r.ended for r in measured), default=start)
    duration = end - start
    in_window = [r for r in records if r.ok and r.ended <= end]
    window_tokens = sum(e.tokens for r in records for e in r.events if start <= e.time <= end)
    input_tokens = sum(r.prompt_tokens or 0 for r in in_window)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    output_throughput = rate(window_tokens)
    ttfts, itls, tpots, e2els = [], [], [], []
    for r in done:
        ttft, gaps = token_latencies(r.sent, r.events)
        if ttft is not None:
            ttfts.append(ttft)
        itls += gaps
        if (t := tpot(r)) is not None:
            tpots.append(t)
        e2els.append(r.ended - r.sent)
    result = {
        "max_concurrency": streams,
        "duration": duration,
        "completed": len(done),
        "failed": len(measured) - len(done),
        "failures": dict(Counter(r.failure for r in records if not r.ok)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": window_tokens,
        "request_throughput": rate(len(in_window)),
        "output_throughput": output_throughput,
        "total_token_throughput": rate(window_tokens + input_tokens),
        "per_stream_output_throughput": output_throughput / streams if output_throughput is not None else None,
        "mean_output_tokens": statistics.mean(r.output_tokens for r in done) if done else None,
    }
    for name, values in zip(LATENCIES, (ttfts, tpots, itls, e2els)):
        result |= distribution(name, values)
    return result


# ---- Prometheus counters ----------------------------------------------------------

Sample = tuple[str, tuple[tuple[str, str], ...]]  # name without prefix or _total, sorted labels


def parse_counters(text: str) -> dict[Sample, float]:
    """Counter samples of a /metrics page, keyed by name and labels. Names lose their
    `prefix:` (laneserve:, vllm:) and `_total`, so one reader serves both servers."""
    samples: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter":
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue  # the _created twin
            name = s.name.rpartition(":")[2].removesuffix("_total")
            samples[(name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def counter_deltas(before: dict[Sample, float], after: dict[Sample, float]) -> dict[Sample, float]:
    """What each counter gained over a cell (a counter first seen after it gained all it has)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _total(deltas: dict[Sample, float], name: str) -> float | None:
    values = [v for (n, _), v in deltas.items() if n == name]
    return sum(values) if values else None


def _by_label(deltas: dict[Sample, float], name: str, label: str) -> dict[str, float]:
    grouped: Counter = Counter()
    for (n, labels), v in deltas.items():
        if n == name:
            value = dict(labels).get(label)
            if value is not None:
                grouped[value] += v
    return dict(grouped)


def spec_decode_metrics(deltas: dict[Sample, float]) -> dict:
    """vLLM's speculative-decoding figures from counter deltas: acceptance rate in percent
    (accepted / draft tokens), acceptance length 1 + accepted / drafts, and per position
    the share of drafts whose draft at that position was accepted; and laneserve's share
    of drafts copied by prompt lookup rather than proposed by the drafter (a text that
    repeats itself is accepted whole, whatever the drafter). None where the server has no
    such counters or drafted nothing."""
    drafts = _total(deltas, "spec_decode_num_drafts")
    draft_tokens = _total(deltas, "spec_decode_num_draft_tokens")
    accepted = _total(deltas, "spec_decode_num_accepted_tokens")
    looked_up = _total(deltas, "prompt_lookup_num_drafts")
    per_position = _by_label(deltas, "spec_decode_num_accepted_tokens_per_pos", "position")
    drafted = bool(drafts)
    positions = sorted(per_position, key=int)
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": draft_tokens,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": 100 * accepted / draft_tokens if drafted and draft_tokens else None,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafted and accepted is not None else None,
        "spec_decode_per_position_acceptance_rates": [per_position[p] / drafts for p in positions] if drafted else None,
        "prompt_lookup_share": looked_up / drafts if drafted and looked_up is not None else None,
    }


def rounds_by_kind(deltas: dict[Sample, float]) -> dict[str, float] | None:
    """Rounds run during a cell by kind (plain, drafted, probe), where the server counts them."""
    found = _by_label(deltas, "rounds", "kind")
    return found or None


def has_spec_decode(samples: Iterable[Sample]) -> bool:
    return any(name == "spec_decode_num_drafts" for name, _ in samples)


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max of one figure over rounds (None values, figures a server lacks, left out)."""
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}

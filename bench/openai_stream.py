"""One streamed request to an OpenAI-compatible server, as a benchmark sees it.

How many tokens an SSE chunk brought decides the inter-token latencies (a drafted round
sends several in one chunk), and servers say it in different ways, so each chunk is
read in this order:
1. the growth of `usage.completion_tokens` when the chunk carries usage (vLLM's
   `stream_options.continuous_usage_stats`, which every request asks for);
2. else the number of its logprobs entries (one per token, when logprobs were asked);
3. else 1 for a chunk that carries text, 0 for one that does not. A server that
   sends one chunk per token (mlx_lm.server) is counted exactly; one that merges tokens
   into a chunk without saying so is counted per chunk, as `vllm bench serve` does.
`token_counting` finds out which of these a server offers. A request's output tokens
are the final usage chunk's `completion_tokens` when sent.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace

import aiohttp

from .serving_metrics import RequestRecord, StreamEvent, parse_counters


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    seed: int | None = None  # sent only when sampling: mlx_lm.server stops batching requests that carry one


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    sampling: Sampling = Sampling()
    draft: bool | None = None  # None: leave the field out (servers without drafting)
    endpoint: str = "chat"  # chat | completions
    model: str | None = None  # None: the server's default model
    top_logprobs: int | None = None  # None: no logprobs; k: the chosen token's and k alternatives

    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self) -> dict:
        body: dict = {
            "max_tokens": self.max_tokens,
            "temperature": self.sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.model is not None:
            body["model"] = self.model
        if self.sampling.temperature > 0 and self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        if self.draft is not None:
            body["draft"] = self.draft
        if self.top_logprobs is not None:
            if self.endpoint == "chat":
                body |= {"logprobs": True, "top_logprobs": self.top_logprobs}
            else:
                body["logprobs"] = self.top_logprobs
        return body


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # alternatives, best first
    utf8: tuple[int, ...] | None = None  # the token's bytes, when the server sends them

    @property
    def identity(self):
        """What tells two tokens apart: their bytes where given (byte tokens of partial
        UTF-8 characters all print as U+FFFD), else their text."""
        return self.utf8 if self.utf8 is not None else self.token


@dataclass
class StreamResult:
    record: RequestRecord
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    usage_per_chunk: bool = False  # content chunks carried usage (continuous usage stats)


class SseDecoder:
    """Splits a byte stream into the data payloads of its SSE events (comments, such as
    `: keepalive`, and other fields ignored; multi-line data joined by newlines)."""

    def __init__(self):
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        payloads = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    payloads.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return payloads


def chunk_logprobs(choice: dict) -> list[TokenLogprob]:
    """A chunk's logprobs in either shape: chat `logprobs.content[{token, logprob,
    top_logprobs}]`, completions `logprobs.{tokens, token_logprobs, top_logprobs}`."""
    logprobs = choice.get("logprobs")
    if not logprobs:
        return []
    if "content" in logprobs:
        return [
            TokenLogprob(
                e.get("token", ""), e.get("logprob", math.nan),
                [(t.get("token", ""), t.get("logprob", math.nan)) for t in e.get("top_logprobs") or []],
                tuple(e["bytes"]) if e.get("bytes") is not None else None,
            )
            for e in logprobs["content"] or []
        ]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or [math.nan] * len(tokens)
    tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
    return [
        TokenLogprob(t, v, sorted((top or {}).items(), key=lambda kv: -kv[1]))
        for t, v, top in zip(tokens, values, tops)
    ]


def chunk_text(choice: dict) -> str:
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


class ChunkReader:
    """Folds a response's chunks into a StreamResult, timing the ones that bring tokens."""

    def __init__(self, result: StreamResult):
        self.result = result
        self._usage_seen = 0

    def add(self, payload: dict, now: float) -> None:
        if "error" in payload:
            error = payload["error"]
            self.result.record.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return
        usage = payload.get("usage")
        choices = payload.get("choices") or []
        tokens = 0
        if choices:
            choice = choices[0]
            text = chunk_text(choice)
            entries = chunk_logprobs(choice)
            self.result.text += text
            self.result.logprobs += entries
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
            if usage and usage.get("completion_tokens") is not None:
                self.result.usage_per_chunk = True
                tokens = usage["completion_tokens"] - self._usage_seen
            elif entries:
                tokens = len(entries)
            else:
                tokens = 1 if text else 0
            if tokens > 0:
                self.result.record.events.append(StreamEvent(now, tokens))
        if usage and usage.get("completion_tokens") is not None:
            self._usage_seen = usage["completion_tokens"]
            if not choices:  # the final usage chunk
                self.result.record.usage_tokens = usage["completion_tokens"]
            if usage.get("prompt_tokens") is not None:
                self.result.record.prompt_tokens = usage["prompt_tokens"]


async def stream(session: aiohttp.ClientSession, url: str, spec: RequestSpec, measured: bool = True) -> StreamResult:
    """Send one streamed request; every failure is recorded, none raised."""
    sent = time.perf_counter()
    result = StreamResult(RequestRecord(sent=sent, ended=sent, status=0, measured=measured))
    reader = ChunkReader(result)
    try:
        async with session.post(url.rstrip("/") + spec.path(), json=spec.body()) as response:
            result.record.status = response.status
            if response.status != 200:
                result.record.error = (await response.text())[:500]
                return result
            decoder = SseDecoder()
            done = False
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for payload in decoder.feed(chunk):
                    if payload.strip() == "[DONE]":
                        done = True
                        break
                    reader.add(json.loads(payload), now)
                if done:
                    break
            if not done and result.record.error is None:
                result.record.error = "the stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        result.record.error = f"{type(e).__name__}: {e}"
    finally:
        result.record.ended = time.perf_counter()
    return result


async def token_counting(session: aiohttp.ClientSession, url: str, spec: RequestSpec) -> str:
    """How a server's chunks tell their token counts: `usage` (continuous usage stats),
    `logprobs` (entries per chunk, when asked for with top_logprobs 0; the server then
    computes logprobs, a little work a plain request would not do) or `chunks` (neither:
    one token per chunk with text)."""
    probe = await stream(session, url, spec)
    if probe.record.ok and probe.usage_per_chunk:
        return "usage"
    probe = await stream(session, url, replace(spec, top_logprobs=0))
    if probe.record.ok and probe.logprobs:
        return "logprobs"
    return "chunks"


async def scrape(session: aiohttp.ClientSession, url: str) -> dict | None:
    """The server's Prometheus counters (serving_metrics.parse_counters), or None when it
    has no /metrics."""
    try:
        async with session.get(url + "/metrics") as response:
            if response.status != 200:
                return None
            return parse_counters(await response.text())
    except (aiohttp.ClientError, ValueError):
        return None

"""The prefix cache through the daemon: `laneserve serve` processes over a tiny checkpoint
with the default budget, a given one and `--prefix-cache-bytes 0`, called with the
official `openai` client. A conversation's second turn resumes from the first and says so
in `usage.prompt_tokens_details.cached_tokens` (whole blocks), with the same text as the
same request with `cache_prompt: false` and as the daemon without a cache; `/metrics`
counts the prompt tokens looked up and found; a bad size is refused in one line."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.cli import byte_size, main
from lanes.prefix_cache import BLOCK_TOKENS
from tests.daemon_server import http, launch_serve

GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8}
USAGE = {"include_usage": True}
BYPASS = {"cache_prompt": False}
SIXTY_FOUR_MB = 64 << 20


@dataclass
class Daemon:
    process: subprocess.Popen
    url: str
    log: list[str]  # its stderr so far, kept filling in the background

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def wait_for(self, pattern: str, seconds: float = 10.0) -> None:
        """Until a log line matches (the access line is written after the reply is sent)."""
        end = time.monotonic() + seconds
        while not re.search(pattern, "".join(self.log)):
            assert time.monotonic() < end, f"no log line matches {pattern!r}:\n" + "".join(self.log)
            time.sleep(0.01)

    def metrics(self) -> dict[str, float]:
        """Every sample of the model's series, by sample name."""
        status, _, body = http("GET", self.url + "/metrics")
        assert status == 200
        return {s.name: s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples
                if s.labels == {"model_name": "tiny"}}


def start(model_dir, *flags: str) -> tuple[subprocess.Popen, threading.Event, list[str], list[str]]:
    return launch_serve("--model", str(model_dir), "--served-model-name", "tiny", *flags)


@pytest.fixture(scope="module")
def daemons(dense_dir):
    """Three daemons started side by side: the default budget, 64 MB, and no cache."""
    flags = {"default": (), "64M": ("--prefix-cache-bytes", "64M"), "off": ("--prefix-cache-bytes", "0")}
    started = {name: start(dense_dir, *given) for name, given in flags.items()}
    served = {}
    try:
        for name, (process, ready, address, log) in started.items():
            if not ready.wait(120) or not address:
                pytest.fail(f"the {name} daemon did not start:\n" + "".join(log))
            served[name] = Daemon(process, address[0], log)
        yield served
    finally:
        for process, *_ in started.values():
            process.send_signal(signal.SIGTERM)
        for process, *_ in started.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def details(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def conversation(topic: str) -> list[dict]:
    """A first turn long enough to fill blocks."""
    return [{"role": "user", "content": f"Tell me about {topic}. " + "Explicit is better than implicit. " * 20}]


def test_startup_logs_the_budget_and_metrics_report_it(daemons):
    log = lambda name: "".join(daemons[name].log)
    assert re.search(r"prefix cache: [\d.]+ MB for prompt prefixes, in blocks of 64 tokens \(a quarter of the memory left\)",
                     log("default"))
    assert "prefix cache: 64.0 MB for prompt prefixes, in blocks of 64 tokens\n" in log("64M")
    assert "prefix cache: off, every prompt read whole" in log("off")
    assert daemons["default"].metrics()["laneserve:prefix_cache_budget_bytes"] > 0
    assert daemons["64M"].metrics()["laneserve:prefix_cache_budget_bytes"] == SIXTY_FOUR_MB
    # Off, every series is still there, at zero.
    off = daemons["off"].metrics()
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_bytes",
                 "prefix_cache_budget_bytes"):
        assert off["laneserve:" + name] == 0


def test_a_chats_second_turn_resumes_from_the_first_with_the_same_text(daemons):
    cached, off = daemons["default"].sdk(), daemons["off"].sdk()
    before = daemons["default"].metrics()
    turn_1 = conversation("the Zen of Python")
    first = cached.chat.completions.create(messages=turn_1, **GREEDY)
    assert details(first.usage) == 0
    turn_2 = turn_1 + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And what follows from that?"}]

    chunks = list(cached.chat.completions.create(messages=turn_2, stream=True, stream_options=USAGE, **GREEDY))
    usage = chunks[-1].usage
    resumed = details(usage)
    assert 0 < resumed < usage.prompt_tokens and resumed % BLOCK_TOKENS == 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    bypassed = cached.chat.completions.create(messages=turn_2, extra_body=BYPASS, **GREEDY)
    assert details(bypassed.usage) == 0 and bypassed.choices[0].message.content == text
    uncached = off.chat.completions.create(messages=turn_2, **GREEDY)
    assert details(uncached.usage) == 0 and uncached.choices[0].message.content == text

    # The bypassing request looked nothing up; the two others count every prompt token.
    after = daemons["default"].metrics()
    moved = lambda name: after["laneserve:" + name] - before["laneserve:" + name]
    assert moved("prefix_cache_queries_total") == first.usage.prompt_tokens + usage.prompt_tokens
    assert moved("prefix_cache_hits_total") == resumed
    assert 0 < after["laneserve:prefix_cache_bytes"] <= after["laneserve:prefix_cache_budget_bytes"]
    access = rf"POST /v1/chat/completions 200 .* prompt={usage.prompt_tokens} .* cached={resumed} drafts"
    daemons["default"].wait_for(access)


def test_a_text_completion_resumes_from_a_prompt_it_extends(daemons):
    cached, off = daemons["64M"].sdk(), daemons["off"].sdk()
    before = daemons["64M"].metrics()
    prompt = [1] + [20 + (7 * i) % 400 for i in range(149)]
    first = cached.completions.create(prompt=prompt, **GREEDY)
    assert details(first.usage) == 0
    longer = prompt + [30 + i for i in range(40)]

    resumed = cached.completions.create(prompt=longer, **GREEDY)
    # Every whole block of the first prompt; the next block holds the first reply instead.
    assert details(resumed.usage) == len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
    chunks = list(cached.completions.create(prompt=longer, stream=True, stream_options=USAGE, **GREEDY))
    assert details(chunks[-1].usage) == len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resumed.choices[0].text

    bypassed = cached.completions.create(prompt=longer, extra_body=BYPASS, **GREEDY)
    uncached = off.completions.create(prompt=longer, **GREEDY)
    assert details(bypassed.usage) == details(uncached.usage) == 0
    assert bypassed.choices[0].text == uncached.choices[0].text == resumed.choices[0].text

    after = daemons["64M"].metrics()
    moved = lambda name: after["laneserve:" + name] - before["laneserve:" + name]
    assert moved("prefix_cache_queries_total") == len(prompt) + 2 * len(longer)
    assert moved("prefix_cache_hits_total") == 2 * details(resumed.usage)
    assert daemons["off"].metrics()["laneserve:prefix_cache_queries_total"] == 0


def test_cache_prompt_must_be_a_boolean(daemons):
    status, _, body = http("POST", daemons["off"].url + "/v1/completions",
                           {"prompt": "hi", "max_tokens": 1, "cache_prompt": "no"})
    assert status == 400 and b'"param":"cache_prompt"' in body


@pytest.mark.parametrize("size", ["lots", "-1", "1.5G", "4X", "", "M"])
def test_a_bad_size_is_refused_in_one_line(dense_dir, capsys, size):
    assert main(["serve", "--model", str(dense_dir), "--prefix-cache-bytes", size]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("laneserve: error: --prefix-cache-bytes must be a number of bytes")
    assert repr(size) in err


@pytest.mark.parametrize("size, bytes_", [("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), ("4g", 4 << 30),
                                          ("2K", 2048), ("1T", 1 << 40)])
def test_sizes_take_plain_bytes_or_a_binary_suffix(size, bytes_):
    assert byte_size(size, "--prefix-cache-bytes") == bytes_

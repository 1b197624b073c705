"""The engine: admission, prefill slices and shared rounds, on one thread that owns MLX.

Each iteration admits waiting requests up to `max_streams`, launches one bounded prefill
slice (so decoding lanes keep a steady inter-token latency while a long prompt is read),
runs one shared round over every decoding lane, then reads the first token of each lane
whose prompt the slice ended (the device runs the round meanwhile; the lane joins the
next round), publishes the tokens, and retires finished or cancelled lanes, freeing
their caches. Other threads talk to it only through
`submit`, `cancel`, `stats` and `end_all`, and receive each request's events through its
`on_event` (the client in `lanes/client.py` wraps all of this for asyncio callers).

Faults stay with their lanes: an exception in a prefill slice or a round finishes the
lanes in it with an error event, and the engine goes on with the next iteration.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import mlx.core as mx

from .detokenize import IncrementalDetokenizer
from .lane import Completion, FinishReason, Lane, LaneEvent, LaneState, Request, Timings
from .prefix_cache import BLOCK_TOKENS, PrefixCache
from .round import PromptRead, RoundRunner
from .sampling import SamplingParams
from .warmup import profile, rehearsal

log = logging.getLogger("laneserve.engine")

# MLX's buffer cache is handed back when the engine goes idle, and while lanes decode only
# once it holds more than this or than the KV the pools reserve (a pool grown or shrunk
# leaves its old buffer there). Freeing it on CUDA waits for the device, and every round
# after allocates its buffers afresh: done as each lane ended, it slowed the rounds of a
# batch's tail and of lanes joining in service.
CACHE_HELD_FLOOR = 1 << 30


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later."""


class RequestError(ValueError):
    """A request the engine cannot serve as asked (the message says why)."""


@dataclass(frozen=True)
class EngineConfig:
    max_streams: int = 16
    max_waiting: int = 64
    prefill_chunk: int = 512  # prompt tokens read per engine iteration
    draft_width: int | None = None  # fixed verify rows per drafted round; None prices them
    prompt_lookup: int = 0  # shortest n-gram match a lane may copy drafts from (lanes/lookup.py); 0: drafter only
    steady_shapes: bool | None = None  # pad rounds to steady shapes; None: where the backend plans per shape (CUDA)
    price_live: bool | None = None  # price from each round's confidences (a second sync); None: where shapes are not steady
    overlap: bool | None = None  # overlap drafted rounds (lanes/round.py); None: where the device runs behind the host
    prefix_cache_bytes: int = 0  # budget of the prefix cache (lanes/prefix_cache.py); 0: no cache
    prefix_block_tokens: int = BLOCK_TOKENS


def context_error(limit: int, prompt: int, max_tokens: int) -> str:
    return (f"This model's maximum context length is {limit} tokens; the prompt has {prompt} "
            f"and max_tokens asks for {max_tokens} ({prompt + max_tokens} in all)")


class Engine:
    def __init__(self, target, tokenizer, eos_ids, drafter=None, config: EngineConfig = EngineConfig(), rounds: RoundRunner | None = None):
        if not 1 <= config.max_streams <= target.max_lanes:
            raise ValueError(f"max_streams must be within 1..{target.max_lanes} (the target's lane slots), got {config.max_streams}")
        self.target = target
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.drafter = drafter
        self.config = config
        self.rounds = rounds or RoundRunner(target, drafter, draft_width=config.draft_width, steady_shapes=config.steady_shapes,
                                            prompt_lookup=config.prompt_lookup, price_live=config.price_live,
                                            overlap=config.overlap)
        self.prefix_cache = (PrefixCache(target, drafter, config.prefix_cache_bytes, config.prefix_block_tokens)
                             if config.prefix_cache_bytes else None)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Lane] = deque()
        self._running: list[Lane] = []
        # Shared with other threads, under _lock: requests not yet finished (by id), how
        # many of them are not admitted yet, the totals stats() reports, and a pending
        # order to end every lane.
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}
        self._queued = 0
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0}
        self._finished_by_reason: Counter[str] = Counter()
        self._gauges: dict[str, int] = {"running": 0, "waiting": 0, "prefilling": 0, "kv_bytes_in_use": 0, "kv_bytes_reserved": 0}
        self._end_all: str | None = None
        # One driver at a time: the engine thread, or a caller of step()/generate().
        self._driver = threading.Lock()
        self.beat = time.monotonic()  # last sign of life of whoever drives the engine

    # ---- any thread ----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; raises RequestError or QueueFull with a message naming why."""
        prompt_len, limit = len(request.prompt), self.target.context_limit
        if prompt_len == 0:
            raise RequestError("the prompt is empty")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if prompt_len + request.max_tokens > limit:
            raise RequestError(context_error(limit, prompt_len, request.max_tokens))
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise RequestError(f"the prompt holds token ids outside the vocabulary (0..{vocab - 1})")
        with self._lock:
            if request.id in self._live:
                raise RequestError(f"a request with id {request.id!r} is already in flight")
            if self._queued >= self.config.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests); retry later")
            self._live[request.id] = request
            self._queued += 1
        self._inbox.put((request, Timings(time.monotonic())))

    def cancel(self, request_id: str) -> bool:
        """Drop a request at the next round boundary, queued or running; its neighbours are
        unaffected. False when no such request is in flight."""
        with self._lock:
            request = self._live.get(request_id)
            if request is None:
                return False
            request.cancelled = True
            return True

    def end_all(self, reason: str) -> None:
        """Finish every lane, queued or running, with an error event saying `reason`, at the
        next iteration (shutdown past its deadline)."""
        with self._lock:
            self._end_all = reason

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._live)

    def stats(self) -> dict:
        """A snapshot of plain values (lanes, queue, tokens, rounds, drafts, guard, KV bytes)."""
        with self._lock:
            snapshot = dict(self._gauges)
            snapshot.update(
                queue_depth=self._queued,
                in_flight=len(self._live),
                prompt_tokens_total=self._totals["prompt_tokens"],
                generation_tokens_total=self._totals["generation_tokens"],
                requests_finished=dict(self._finished_by_reason),
            )
        snapshot.update(max_streams=self.config.max_streams, max_waiting=self.config.max_waiting,
                        context_limit=self.target.context_limit)
        snapshot.update(self.rounds.counters.snapshot())
        if self.prefix_cache is not None:
            snapshot["prefix_cache"] = self.prefix_cache.stats()
        guard = self.rounds.guard.snapshot()
        snapshot["guard"] = guard
        snapshot["guard_drafting"] = {band: int(bool(state.get("drafting"))) for band, state in guard.items()}
        return snapshot

    # ---- the driver -------------------------------------------------------------------

    def warm_up(self) -> None:
        """Prepare to serve; call on the engine thread before the first request.

        First a little synthetic traffic takes every path a round can (batched prefill,
        pipelined plain rounds, drafted rounds with partial accepts and lanes that do
        not draft, context folds; on a GPU, sampled lanes with every filter, a
        repetition penalty and logprobs too, as the default model's generation_config
        asks for), at one lane and at `max_streams`, so that what a backend builds on
        first use (kernels, plans) exists before a guard times it or a request waits on
        it. The CPU's kernels are built in: sampled lanes would only slow its start.
        What that traffic would teach (guard evidence, calibration, round costs,
        counters) goes to throwaway instances, and it counts in no total. Then every
        steady shape runs once and the cost table is seeded (see lanes/warmup.py), and the
        buffers all that allocated go back to the backend."""
        lanes, vocab = self.config.max_streams, self.target.vocab_size
        rows = 2 * (self.rounds.proposals + 1) if self.drafter is not None else 4
        prompt = lambda i: [1 + (7 * i + j) % (vocab - 1) for j in range(8 + 3 * i)]
        on_gpu = self.target.runs_behind_host()
        sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=0)

        def warm(i: int, draft: bool = True, sample: bool = False, logprobs: int | None = None) -> Request:
            return Request(prompt(i), rows, sampled if sample and on_gpu else SamplingParams(), draft=draft,
                           logprobs=logprobs if on_gpu else None, id=f"warm-up-{i}")

        batches = [
            # drafted, some lanes plain; then plain, pipelined; each lane sampled in one of them
            [warm(i, i % 4 != 3, i % 2 == 1, 2 if i % 4 == 1 else None) for i in range(lanes)],
            [warm(i, False, i % 2 == 0, 2 if i % 4 == 0 else None) for i in range(lanes)],
            [warm(0, True, True, 2)],  # one lane
        ]
        if self.prefix_cache is not None:  # a prefix read, then resumed: its copies run kernels of their own
            block = self.prefix_cache.block_tokens
            length = min(2 * block + 1, self.target.context_limit - rows)
            if length > block:
                read = [1 + j % (vocab - 1) for j in range(length)]
                batches += [[Request(read, rows, id="warm-up-0")], [Request(read, rows, id="warm-up-0")]]
        with self._lock:
            totals, finished = dict(self._totals), Counter(self._finished_by_reason)
        with rehearsal(self.rounds):
            for batch in batches:
                self.generate(batch)
        with self._lock:
            self._totals, self._finished_by_reason = totals, finished
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        profile(self.rounds, self.config.max_streams, prompt_chunk=self.config.prefill_chunk)
        # The profile read prompts at every steady shape; an idle engine holds none of it.
        mx.clear_cache()

    def run(self, stopping: threading.Event, wake: threading.Event) -> None:
        """The engine thread's loop: step until `stopping` is set and nothing is in flight
        (or everything was ended); beat at least every 50 ms while idle."""
        with self._driver:
            while True:
                busy = self._step()
                if stopping.is_set() and not busy:
                    return
                if not busy:
                    wake.wait(0.05)
                    wake.clear()

    def step(self) -> bool:
        """One iteration on the calling thread; False when there was nothing to do."""
        if not self._driver.acquire(blocking=False):
            raise RuntimeError("the engine is already driven by another thread (a started client): submit requests to it instead")
        try:
            return self._step()
        finally:
            self._driver.release()

    def run_until_idle(self) -> None:
        """Drive the engine on the calling thread until every request has finished."""
        while self.step():
            pass

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` on the calling thread and return their completions in order."""
        done: dict[str, Completion] = {}
        for request in requests:
            request.on_event = _collecting(request.on_event, done)
            self.submit(request)
        self.run_until_idle()
        return [done[r.id] for r in requests]

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> int:
        return sum(lane.state is LaneState.PREFILLING for lane in self._running)

    def _step(self) -> bool:
        self.beat = time.monotonic()
        try:
            self._take_inbox()
            self._drop_cancelled()
            self._admit()
            prefilling = [lane for lane in self._running if lane.state is LaneState.PREFILLING]
            read = self._prefill_slice(prefilling) if prefilling else None
            decoding = [lane for lane in self._running if lane.state is LaneState.DECODING and not lane.finished]
            if decoding:
                self._round(decoding)
            else:
                self.rounds.idle()
            if read is not None:  # after the round is launched: the device runs it while the host waits for these
                self._first_tokens(read)
        except Exception as e:  # a fault outside any one slice or round: end what is running, go on
            log.exception("engine iteration failed")
            self.rounds.idle()
            for lane in self._running:
                if not lane.finished:
                    self._publish(lane, lane.finish(FinishReason.ERROR, f"engine fault: {type(e).__name__}: {e}"))
        self._retire()
        self._publish_gauges()
        return bool(self._running or self._waiting or not self._inbox.empty())

    def _round(self, decoding: list[Lane]) -> None:
        try:
            published = self.rounds.run(decoding)
        except Exception as e:  # the failure stays with this round's lanes
            log.exception("round failed for %s", [lane.id for lane in decoding])
            self.rounds.idle()  # a round in flight is dropped with its lanes
            for lane in decoding:
                if not lane.finished:
                    self._publish(lane, lane.finish(FinishReason.ERROR, f"round failed: {type(e).__name__}: {e}"))
                elif self._unpublished(lane):  # it ended as a round landed, before the failure: its last event still goes out
                    self._publish(lane, lane.final_event)
            return
        for lane, event in published:
            self._publish(lane, event)

    def _take_inbox(self) -> None:
        while True:
            try:
                request, timings = self._inbox.get_nowait()
            except queue.Empty:
                return
            detokenizer = IncrementalDetokenizer(self.tokenizer.decode)
            self._waiting.append(Lane(request, self.eos_ids, self.target.context_limit, detokenizer, timings))

    def _drop_cancelled(self) -> None:
        with self._lock:
            reason, self._end_all = self._end_all, None
        for lane in [*self._waiting, *self._running]:
            if lane.finished:
                continue
            if reason is not None:
                self._publish(lane, lane.finish(FinishReason.ERROR, reason))
            elif lane.request.cancelled:
                self._publish(lane, lane.finish(FinishReason.CANCELLED))
        if any(lane.finished for lane in self._waiting):
            self._waiting = deque(lane for lane in self._waiting if not lane.finished)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_streams:
            lane = self._waiting.popleft()
            with self._lock:
                self._queued -= 1
                self._totals["prompt_tokens"] += len(lane.request.prompt)
            lane.timings.admitted = time.monotonic()
            lane.state = LaneState.PREFILLING
            self._running.append(lane)  # retired (slots closed) however it ends
            try:
                lane.target_slot = self.target.open_lane()
                if self.drafter is not None and lane.request.draft:
                    lane.drafter_slot = self.drafter.open_lane()
                if self.prefix_cache is not None and lane.request.cache:
                    lane.cached_tokens = lane.prefilled = self.prefix_cache.attach(lane)
            except Exception as e:
                log.exception("admitting %s failed", lane.id)
                self._publish(lane, lane.finish(FinishReason.ERROR, f"admission failed: {type(e).__name__}: {e}"))

    def _prefill_slice(self, prefilling: list[Lane]) -> PromptRead | None:
        """Launch at most `prefill_chunk` prompt tokens, oldest lanes first, several lanes'
        chunks in one forward when their prompts are short (None where it failed)."""
        lanes, chunks, budget = [], [], self.config.prefill_chunk
        for lane in prefilling:
            if budget == 0:
                break
            chunk = lane.request.prompt[lane.prefilled : lane.prefilled + budget]
            lanes.append(lane)
            chunks.append(chunk)
            budget -= len(chunk)
        try:
            read = self.rounds.prefill(lanes, chunks)
        except Exception as e:  # the failure stays with these lanes; the decoding ones go on
            self._prefill_failed(lanes, e)
            return None
        for lane, chunk in zip(lanes, chunks):
            lane.prefilled += len(chunk)
        return read

    def _first_tokens(self, read: PromptRead) -> None:
        """Emit the first token of each lane whose prompt `read` ended: it decodes from here."""
        try:
            firsts = self.rounds.first_tokens(read)
        except Exception as e:
            self._prefill_failed(read.lanes, e)
            return
        for lane, (token, logprob) in zip(read.lanes, firsts):
            lane.state = LaneState.DECODING
            self._publish(lane, lane.emit([token], None if logprob is None else [logprob]))

    def _prefill_failed(self, lanes: list[Lane], e: Exception) -> None:
        log.exception("prefill failed for %s", [lane.id for lane in lanes])
        for lane in lanes:
            self._publish(lane, lane.finish(FinishReason.ERROR, f"prefill failed: {type(e).__name__}: {e}"))

    def _unpublished(self, lane: Lane) -> bool:
        """Whether the event that ended `lane` has not been published yet."""
        with self._lock:
            return lane.id in self._live

    def _publish(self, lane: Lane, event: LaneEvent) -> None:
        with self._lock:
            self._totals["generation_tokens"] += len(event.token_ids)
            if event.finish_reason is not None:
                self._live.pop(lane.id, None)
                if lane.timings.admitted is None:  # ended while queued
                    self._queued -= 1
                self._finished_by_reason[event.finish_reason.value] += 1
        if lane.request.on_event is not None:
            try:
                lane.request.on_event(event)
            except Exception:  # a consumer's fault must not stop the engine
                log.exception("event consumer of %s failed", lane.id)

    def _retire(self) -> None:
        finished = [lane for lane in self._running if lane.finished]
        if not finished:
            return
        for lane in finished:
            if self.prefix_cache is not None:
                self._offer(lane)
            if lane.target_slot is not None:
                self.target.close_lane(lane.target_slot)
                lane.target_slot = None
            if lane.drafter_slot is not None:
                self.drafter.close_lane(lane.drafter_slot)
                lane.drafter_slot = None
            lane.pending_taps, lane.pending_tokens = [], []
        self._running = [lane for lane in self._running if not lane.finished]
        reserved = self.target.kv_bytes() + (self.drafter.kv_bytes() if self.drafter is not None else 0)
        if not self._running or mx.get_cache_memory() > max(CACHE_HELD_FLOOR, reserved):
            mx.clear_cache()

    def _offer(self, lane: Lane) -> None:
        """Give a finished lane's blocks to the prefix cache (not a faulted lane's: its
        caches may be part-written; nor one that asked to bypass the cache) and unpin the
        ones it resumed from."""
        try:
            if lane.request.cache and lane.finish_reason is not FinishReason.ERROR and lane.target_slot is not None:
                if lane.drafter_slot is not None:
                    self.rounds.fold_pending([lane])  # its blocks carry the drafter's context to the last row
                self.prefix_cache.offer(lane)
        except Exception:  # the cache only loses this lane's blocks
            log.exception("offering %s to the prefix cache failed", lane.id)
        finally:
            self.prefix_cache.release(lane)

    def _publish_gauges(self) -> None:
        in_use = self.target.kv_bytes_in_use() + (self.drafter.kv_bytes_in_use() if self.drafter is not None else 0)
        reserved = self.target.kv_bytes() + (self.drafter.kv_bytes() if self.drafter is not None else 0)
        gauges = {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "prefilling": self.prefilling,
            "kv_bytes_in_use": in_use,
            "kv_bytes_reserved": reserved,
        }
        with self._lock:
            self._gauges = gauges


def _collecting(consumer, done: dict[str, Completion]):
    """An on_event that records the completion of the final event, then passes it on."""

    def on_event(event: LaneEvent) -> None:
        if event.completion is not None:
            done[event.request_id] = event.completion
        if consumer is not None:
            consumer(event)

    return on_event

"""The engine: admission, prefill slices and shared rounds, on one thread that owns MLX.

Each iteration admits waiting requests up to `max_streams`, reads one bounded prefill
slice (so decoding lanes keep a steady inter-token latency while a long prompt is read),
runs one shared round over every decoding lane, publishes the tokens, and retires
finished or cancelled lanes, freeing their caches. Other threads talk to it only through
`submit` / `cancel` and the events a request's `on_event` receives.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from .detokenize import IncrementalDetokenizer
from .lane import Completion, FinishReason, Lane, LaneEvent, LaneState, Request
from .round import RoundRunner

log = logging.getLogger("laneserve.engine")


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
    steady_shapes: bool | None = None  # pad rounds to steady shapes; None: where the backend plans per shape (CUDA)


class Engine:
    def __init__(self, target, tokenizer, eos_ids, drafter=None, config: EngineConfig = EngineConfig(), rounds: RoundRunner | None = None):
        if not 1 <= config.max_streams <= target.max_lanes:
            raise ValueError(f"max_streams must be within 1..{target.max_lanes} (the target's lane slots), got {config.max_streams}")
        self.target = target
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.drafter = drafter
        self.config = config
        self.rounds = rounds or RoundRunner(target, drafter, draft_width=config.draft_width, steady_shapes=config.steady_shapes)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Lane] = deque()
        self._running: list[Lane] = []
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._queued = 0  # requests submitted but not yet admitted
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.completions: dict[str, Completion] = {}

    # ---- other threads ---------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; raises RequestError or QueueFull with a message naming why."""
        prompt_len, limit = len(request.prompt), self.target.context_limit
        if prompt_len == 0:
            raise RequestError("the prompt is empty")
        if request.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if prompt_len + request.max_tokens > limit:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({request.max_tokens}) exceeds the context limit of {limit} tokens"
            )
        with self._lock:
            if self._queued >= self.config.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests); retry later")
            self._queued += 1
        self._inbox.put(request)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Drop a request at the next round boundary; its neighbours are unaffected."""
        with self._lock:
            self._cancelled.add(request_id)
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="laneserve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the engine thread -----------------------------------------------------

    def warm_up(self) -> None:
        """Prepare to serve; call on the engine thread before the first request.

        First a little synthetic traffic takes every path a round can (batched prefill,
        pipelined plain rounds, drafted rounds with partial accepts and lanes that do
        not draft, context folds), at one lane and at `max_streams`, so that what a
        backend builds on first use (kernels, plans) exists before a guard times it.
        What that traffic would teach (guard evidence, calibration, round costs,
        counters) goes to throwaway instances. Then the cost table is seeded by the
        round runner's short profile."""
        lanes, vocab = self.config.max_streams, self.target.vocab_size
        rows = 2 * (self.rounds.proposals + 1) if self.drafter is not None else 4
        prompt = lambda i: [1 + (7 * i + j) % (vocab - 1) for j in range(8 + 3 * i)]
        batches = [
            [Request(prompt(i), rows, draft=i % 4 != 3) for i in range(lanes)],  # drafted, some lanes plain
            [Request(prompt(i), rows, draft=False) for i in range(lanes)],  # plain, pipelined
            [Request(prompt(0), rows)],
        ]
        with self.rounds.rehearsal():
            for batch in batches:
                for done in self.generate(batch):
                    del self.completions[done.request_id]
        self.rounds.warm_up(self.config.max_streams)

    def _run(self) -> None:
        while not self._stopping:
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()

    def run_until_idle(self) -> None:
        """Drive the engine on the calling thread until every request has finished."""
        while self.step():
            pass

    def generate(self, requests: list[Request]) -> list[Completion]:
        for request in requests:
            self.submit(request)
        self.run_until_idle()
        return [self.completions[r.id] for r in requests]

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> int:
        return sum(lane.state is LaneState.PREFILLING for lane in self._running)

    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        prefilling = [lane for lane in self._running if lane.state is LaneState.PREFILLING]
        if prefilling:
            self._prefill_slice(prefilling)
        decoding = [lane for lane in self._running if lane.state is LaneState.DECODING]
        if decoding:
            for lane, event in self.rounds.run(decoding):
                self._publish(lane, event)
        else:
            self.rounds.idle()
        self._retire()
        return bool(self._running or self._waiting or not self._inbox.empty())

    def _take_inbox(self) -> None:
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return
            detokenizer = IncrementalDetokenizer(self.tokenizer.decode)
            self._waiting.append(Lane(request, self.eos_ids, self.target.context_limit, detokenizer))

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        if not cancelled:
            return
        for lane in [*self._waiting, *self._running]:
            if lane.id in cancelled and not lane.finished:
                self._publish(lane, lane.finish(FinishReason.CANCELLED))
        self._waiting = deque(lane for lane in self._waiting if not lane.finished)
        with self._lock:
            self._queued = len(self._waiting) + self._inbox.qsize()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_streams:
            lane = self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            lane.target_slot = self.target.open_lane()
            if self.drafter is not None and lane.request.draft:
                lane.drafter_slot = self.drafter.open_lane()
            lane.state = LaneState.PREFILLING
            self._running.append(lane)

    def _prefill_slice(self, prefilling: list[Lane]) -> None:
        """Read at most `prefill_chunk` prompt tokens, oldest lanes first, several lanes'
        chunks in one forward when their prompts are short."""
        lanes, chunks, budget = [], [], self.config.prefill_chunk
        for lane in prefilling:
            if budget == 0:
                break
            chunk = lane.request.prompt[lane.prefilled : lane.prefilled + budget]
            lanes.append(lane)
            chunks.append(chunk)
            budget -= len(chunk)
        try:
            logits = self.rounds.prefill(lanes, chunks)
        except Exception as e:  # the failure stays with these lanes; the decoding ones go on
            log.exception("prefill failed for %s", [lane.id for lane in lanes])
            for lane in lanes:
                self._publish(lane, lane.finish(FinishReason.ERROR, f"{type(e).__name__}: {e}"))
            return
        read = []
        for i, (lane, chunk) in enumerate(zip(lanes, chunks)):
            lane.prefilled += len(chunk)
            if lane.prefilled == len(lane.request.prompt):
                read.append(i)
        if read:
            firsts = self.rounds.first_tokens([lanes[i] for i in read], logits[mx.array(read)])
            for i, first in zip(read, firsts):
                lanes[i].state = LaneState.DECODING
                self._publish(lanes[i], lanes[i].emit([first]))

    def _publish(self, lane: Lane, event: LaneEvent) -> None:
        if lane.request.on_event is not None:
            lane.request.on_event(event)
        if event.finish_reason is not None:
            self.completions[lane.id] = lane.completion()

    def _retire(self) -> None:
        finished = [lane for lane in self._running if lane.finished]
        if not finished:
            return
        for lane in finished:
            self.target.close_lane(lane.target_slot)
            if lane.drafter_slot is not None:
                self.drafter.close_lane(lane.drafter_slot)
            lane.pending_taps, lane.pending_tokens = [], []
        self._running = [lane for lane in self._running if not lane.finished]
        mx.clear_cache()

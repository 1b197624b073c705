"""The boundary between the lane core and its callers (the HTTP daemon, `generate`).

`EngineClient` owns the engine thread. Callers submit a `Request` and get a
`RequestHandle` whose events arrive as an async iterator on the caller's asyncio loop
(hopped there with `call_soon_threadsafe`: only Python values cross threads). Every
request ends with exactly one final event, whatever happens: its tokens run out, it is
cancelled (also before admission), a fault ends its round, the server shuts down, or the
engine thread itself dies. The heartbeat tells a live engine from a stalled or dead one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from .engine import Engine
from .lane import Completion, DraftStats, FinishReason, LaneEvent, Request, Timings

log = logging.getLogger("laneserve.client")

SHUTTING_DOWN = "server shutting down"
# Warm-up rehearses every round shape before serving, and a backend may build plans for
# each: it can take minutes on a large model, which is not a stall.
WARM_UP_STALL_SECONDS = 600.0


class EngineUnavailable(RuntimeError):
    """The engine takes no requests: it is draining, stopped, or its thread has died."""


@dataclass(frozen=True)
class Health:
    alive: bool  # the engine thread runs
    stalled: bool  # ... but has shown no sign of life for longer than the stall bound
    seconds_since_beat: float
    error: str | None = None  # why the thread died, when it did

    @property
    def ok(self) -> bool:
        return self.alive and not self.stalled


class RequestHandle:
    """One request's events, in order, as an async iterator; iteration ends after the
    final event (the one with a `finish_reason`, carrying the `completion`)."""

    def __init__(self, request: Request, client: EngineClient, loop: asyncio.AbstractEventLoop):
        self.request = request
        self._client = client
        self._loop = loop
        self._events: asyncio.Queue[LaneEvent] = asyncio.Queue()
        self._ended = False  # the final event was handed to the loop (engine side)
        self._done = False  # the final event was read (caller side)
        self._tokens: list[int] = []  # delivered so far, for a completion the engine never made
        self._text = ""

    @property
    def id(self) -> str:
        return self.request.id

    def cancel(self) -> None:
        self._client.cancel(self.id)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> LaneEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._events.get()
        if event.finish_reason is not None:
            self._done = True
        return event

    async def completion(self) -> Completion:
        """Read the remaining events; the request's completion."""
        last = None
        async for last in self:
            pass
        if last is None:
            raise RuntimeError(f"request {self.id}: its events were already read")
        return last.completion

    # ---- the engine thread (or the client's cleanup) -----------------------------------

    def _deliver(self, event: LaneEvent) -> None:
        if self._ended:
            return
        self._tokens += event.token_ids
        self._text += event.text
        if event.finish_reason is not None:
            self._ended = True
            self._client._forget(self.id)
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the caller's loop is closed: nobody reads this request any more
            self._client.cancel(self.id)

    def _abandon(self, reason: str) -> None:
        """End the request from outside the engine (its thread is gone)."""
        timings = Timings(time.monotonic(), finished=time.monotonic())
        completion = Completion(self.id, len(self.request.prompt), list(self._tokens), self._text, FinishReason.ERROR,
                                DraftStats(), reason, timings)
        self._deliver(LaneEvent(self.id, [], "", FinishReason.ERROR, reason, completion=completion))


class EngineClient:
    """Runs an `Engine` on its own thread and serves requests to asyncio callers."""

    def __init__(self, engine: Engine, stall_seconds: float = 30.0):
        if not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be positive, got {stall_seconds}")
        self.engine = engine
        self.stall_seconds = stall_seconds
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._draining = False
        self._closed = False  # the thread has ended (or is ending): no request can be served
        self._error: str | None = None

    # ---- lifecycle ------------------------------------------------------------------

    def start(self, warm_up: bool = False) -> None:
        """Start the engine thread (after a `shutdown`, a new one); with `warm_up`, the
        engine rehearses its rounds on that thread before `ready` turns true."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise RuntimeError("the engine thread is already running")
            self._stopping.clear()
            self._ready.clear()
            self._draining, self._closed, self._error = False, False, None
            self._thread = threading.Thread(target=self._main, args=(warm_up,), name="laneserve-engine", daemon=True)
            self._thread.start()

    @property
    def ready(self) -> bool:
        """Serving: warmed up, and not draining."""
        return self._ready.is_set() and not self._draining and self.health().alive

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for warm-up to end; False at the timeout, or at once if the thread died."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if not self.health().alive or (end is not None and time.monotonic() >= end):
                return False
        return self.ready

    def shutdown(self, deadline: float) -> None:
        """Stop admitting, let running requests finish for up to `deadline` seconds, end
        the rest with a final error event, and stop the engine thread. Blocking: from
        async code, run it in an executor."""
        with self._lock:
            self._draining = True
        end = time.monotonic() + max(deadline, 0.0)
        while self.engine.in_flight and time.monotonic() < end and self.health().alive:
            time.sleep(0.01)
        if self.engine.in_flight:
            self.engine.end_all(SHUTTING_DOWN)
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=30.0)
            if thread.is_alive():
                log.error("the engine thread did not stop within 30 s of shutdown")

    def _main(self, warm_up: bool) -> None:
        try:
            if warm_up:
                self.engine.warm_up()
            self._ready.set()
            self.engine.run(self._stopping, self._wake)
        except BaseException as e:
            self._error = f"{type(e).__name__}: {e}"
            log.exception("the engine thread died")
        finally:
            self._abandon_all(self._error or SHUTTING_DOWN)

    def _abandon_all(self, reason: str) -> None:
        """The thread is ending: every request not yet finished gets its final event."""
        with self._lock:
            self._closed = True
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle._abandon(reason)

    # ---- requests ---------------------------------------------------------------------

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request; its events arrive on `loop` (by default the running loop).
        Raises RequestError, QueueFull, or EngineUnavailable, each naming why."""
        if loop is None:
            loop = asyncio.get_running_loop()
        handle = RequestHandle(request, self, loop)
        request.on_event = handle._deliver
        with self._lock:
            if self._closed or not self.health().alive:
                raise EngineUnavailable(f"the engine is not running{f' ({self._error})' if self._error else ''}")
            if self._draining:
                raise EngineUnavailable("the server is shutting down")
            self.engine.submit(request)  # raises RequestError / QueueFull
            self._handles[request.id] = handle
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> bool:
        """Drop a request at the next round boundary, queued or running. False when it is
        not in flight (already finished, or never submitted)."""
        cancelled = self.engine.cancel(request_id)
        self._wake.set()
        return cancelled

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._handles.pop(request_id, None)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` and wait for their completions (for code without an asyncio
        loop: the CLI, tests). Without a started thread, the calling thread drives."""
        if self._thread is None or not self._thread.is_alive():
            return self.engine.generate(requests)

        async def serve() -> list[Completion]:
            handles = [self.submit(request) for request in requests]
            return [await handle.completion() for handle in handles]

        return asyncio.run(serve())

    # ---- introspection ----------------------------------------------------------------------

    def health(self) -> Health:
        alive = self._thread is not None and self._thread.is_alive()
        since = time.monotonic() - self.engine.beat
        bound = self.stall_seconds if self._ready.is_set() else max(self.stall_seconds, WARM_UP_STALL_SECONDS)
        return Health(alive, alive and since > bound, since, self._error)

    def stats(self) -> dict:
        """The engine's snapshot (see Engine.stats) plus the client's state."""
        snapshot = self.engine.stats()
        snapshot.update(ready=self.ready, draining=self._draining)
        return snapshot

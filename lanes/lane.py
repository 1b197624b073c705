"""A request and the lane that serves it: its tokens, stop conditions and output.

Only Python values live here, so lanes and events cross threads freely; the caches a
lane owns in the target and the drafter are handles into those models' pools.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .detokenize import IncrementalDetokenizer
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from .sampling import SamplingParams
from .stops import StopMatcher

_request_ids = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an eos id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    draft: bool = True
    cache: bool = True  # resume from the prefix cache where it holds this prompt's start, and leave its blocks there
    id: str = field(default_factory=lambda: f"req-{next(_request_ids)}")
    logprobs: int | None = None  # None: off; k: each token's logprob and its k best alternatives
    # Called on the engine thread with each LaneEvent; the client hops it onto its loop.
    on_event: Callable[[LaneEvent], None] | None = None
    # Set from any thread; the engine drops the request at its next round boundary. A flag
    # on the request itself cannot be lost, whether the request is queued or running.
    cancelled: bool = field(default=False, compare=False)

    def __post_init__(self):
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be within 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")


@dataclass
class DraftStats:
    rounds: int = 0  # rounds this lane took part in
    drafted_rounds: int = 0
    proposed: int = 0  # drafts verified by the target
    accepted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    looked_up_rounds: int = 0  # drafted rounds whose drafts were looked up in the lane's own tokens
    errors: list[str] = field(default_factory=list)  # DraftErrors seen (the lane went on plain)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted_rounds": self.drafted_rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "accepted_per_round": list(self.accepted_per_round),
            "looked_up_rounds": self.looked_up_rounds,
        }


@dataclass
class Timings:
    """time.monotonic() stamps of a request's life (None until reached)."""

    submitted: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @staticmethod
    def _between(start: float | None, end: float | None) -> float:
        return end - start if start is not None and end is not None else 0.0

    @property
    def queue_seconds(self) -> float:
        return self._between(self.submitted, self.admitted)

    @property
    def prefill_seconds(self) -> float:
        return self._between(self.admitted, self.first_token)

    @property
    def decode_seconds(self) -> float:
        return self._between(self.first_token, self.finished)

    @property
    def ttft_seconds(self) -> float:
        return self._between(self.submitted, self.first_token)


@dataclass
class Completion:
    request_id: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    draft: DraftStats
    error: str | None = None
    timings: Timings | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache


@dataclass
class LaneEvent:
    request_id: str
    token_ids: list[int]  # new tokens this round
    text: str  # new text safe to show (stop strings and incomplete UTF-8 held back)
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    time: float = field(default_factory=time.monotonic)
    completion: Completion | None = None  # on the final event only


class LaneState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class Lane:
    """One stream. The target has committed `prompt + generated[:-1]`; the last generated
    token is the anchor, fed at the next round."""

    def __init__(self, request: Request, eos_ids: frozenset[int], context_limit: int, detokenizer: IncrementalDetokenizer,
                 timings: Timings | None = None):
        self.request = request
        self.timings = timings or Timings(time.monotonic())
        self.seed = request.sampling.seed if request.sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.eos_ids = eos_ids
        self.context_limit = context_limit
        self.state = LaneState.WAITING
        self.prefilled = 0  # prompt tokens read so far
        self.generated: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.stats = DraftStats()
        self.target_slot = None  # the target's cache handle
        self.drafter_slot = None  # the drafter's cache handle, when drafting is possible
        # Committed rows not yet in the drafter's context: their taps, as (a round's taps,
        # first row, end row), and token ids.
        self.pending_taps: list = []
        self.pending_tokens: list[int] = []
        self.ngrams = None  # an NgramIndex of the lane's tokens, once prompt lookup asks for one
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache, not read
        self.cached_blocks: list = []  # the prefix cache's blocks this lane pins while it runs
        self.final_event: LaneEvent | None = None  # the event that ended it, once it has ended
        self._detokenizer = detokenizer
        self._stops = StopMatcher(request.stop)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def anchor(self) -> int:
        return self.generated[-1]

    @property
    def position(self) -> int:
        """Absolute position of the anchor (= tokens the target has committed)."""
        return len(self.request.prompt) + len(self.generated) - 1

    @property
    def context(self) -> int:
        return len(self.request.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens this lane may still emit."""
        return min(self.request.max_tokens - len(self.generated), self.context_limit - self.context)

    @property
    def finished(self) -> bool:
        return self.state is LaneState.FINISHED

    def emit(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> LaneEvent:
        """Append this round's tokens, stopping at the first eos id, stop string or limit.

        With stop strings, tokens go through the detokenizer and the stop matcher one at a
        time, so a round that brings several tokens keeps exactly the ids a plain run
        would: none after the token that completes a stop string. Without, the round's
        tokens are decoded together (the text is the same; a decode per token is the
        host's largest cost per emitted token)."""
        kept: list[int] = []
        room = self.remaining
        for token in tokens:
            if len(kept) >= room:
                self.finish_reason = FinishReason.LENGTH
                break
            if token in self.eos_ids:
                self.finish_reason = FinishReason.STOP
                break
            kept.append(token)
        text = ""
        hit = False
        if self._stops.watching:
            for count, token in enumerate(kept, 1):
                self.generated.append(token)
                safe, hit = self._stops.feed(self._detokenizer.add([token]))
                text += safe
                if hit:
                    self.finish_reason = FinishReason.STOP
                    kept = kept[:count]
                    break
        elif kept:
            self.generated += kept
            text = self._detokenizer.add(kept)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None and not hit:
            text += self._stops.feed(self._detokenizer.flush())[0] + self._stops.flush()
        self.text += text
        if kept and self.timings.first_token is None:
            self.timings.first_token = time.monotonic()
        event = LaneEvent(self.id, kept, text, self.finish_reason, logprobs=logprobs[: len(kept)] if logprobs is not None else None)
        if self.finish_reason is not None:
            self._finish(event)
        return event

    def finish(self, reason: FinishReason, error: str | None = None) -> LaneEvent:
        """End the lane now (cancel, fault, shutdown): a final event with no tokens."""
        self.finish_reason, self.error = reason, error
        event = LaneEvent(self.id, [], "", reason, error)
        self._finish(event)
        return event

    def _finish(self, event: LaneEvent) -> None:
        self.final_event = event
        self.state = LaneState.FINISHED
        self.timings.finished = event.time
        event.completion = self.completion()

    def completion(self) -> Completion:
        return Completion(
            self.id, len(self.request.prompt), list(self.generated), self.text, self.finish_reason, self.stats, self.error,
            self.timings, self.cached_tokens,
        )

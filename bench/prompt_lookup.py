"""Prompt-lookup drafting (n-gram matching), the baseline a trained drafter must beat.

It proposes by finding the latest earlier occurrence of the lane's last n tokens
(n = max_ngram down to 1) in its own prompt + output and copying what followed. It
speaks the lane core's drafter protocol for rounds taken one at a time, so the engine
runs it like DSpark there: same rounds, same verification, same counters. It proposes
from the lane's tokens on the host, so it cannot propose from anchors only the device
holds: an engine running it needs `EngineConfig(overlap=False)`. Measurement only.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from families.lfm2.cache import LaneSlot


@dataclass(frozen=True)
class LookupConfig:
    max_width: int


@dataclass
class LookupProposal:
    tokens: mx.array
    confidences: mx.array
    logits: mx.array | None  # None when the lane core asks for no chain logits

    def arrays(self) -> list[mx.array]:
        return [self.tokens, self.confidences] + ([self.logits] if self.logits is not None else [])


class PromptLookupDrafter:
    # The engine keeps taps for drafting lanes; the cheapest layer's are asked for and ignored.
    tap_layers = (0,)

    def __init__(self, vocab_size: int, width: int, max_ngram: int = 3, max_lanes: int = 16):
        self.vocab_size = vocab_size
        self.width = width
        self.max_ngram = max_ngram
        self.config = LookupConfig(width)
        self._history: dict[int, list[int]] = {}
        self._free = list(range(max_lanes))

    def open_lane(self) -> LaneSlot:
        slot = self._free.pop(0)
        self._history[slot] = []
        return LaneSlot(slot)

    def close_lane(self, lane: LaneSlot) -> None:
        del self._history[lane.slot]
        self._free.append(lane.slot)

    def append(self, lanes, taps, tokens, bucket_rows=False) -> None:  # no arrays, so nothing to pad
        for lane, ids in zip(lanes, tokens):
            self._history[lane.slot] += ids
            lane.length += len(ids)

    def state_arrays(self) -> list[mx.array]:
        return []

    def kv_bytes(self) -> int:
        return 0

    def kv_bytes_in_use(self) -> int:
        return 0

    def validate(self, proposal) -> list[None]:
        return [None] * proposal.tokens.shape[0]

    def propose(self, lanes, anchors, width=None, pick=None, *, chain_logits=True, confidences=True) -> LookupProposal:
        g = width or self.width
        tokens, scores = [], []  # given whether asked for or not: they cost nothing here
        for lane, anchor in zip(lanes, anchors):
            found = self.lookup(self._history[lane.slot] + [anchor], g)
            tokens.append(found + [0] * (g - len(found)))
            scores.append([1.0] * len(found) + [0.0] * (g - len(found)))
        tokens_arr = mx.array(tokens, dtype=mx.int32)
        peaked = mx.where(mx.arange(self.vocab_size)[None, None, :] == tokens_arr[:, :, None], 30.0, 0.0) if chain_logits else None
        return LookupProposal(tokens_arr, mx.array(scores, dtype=mx.float32), peaked)

    def lookup(self, sequence: list[int], g: int) -> list[int]:
        """Up to g tokens that followed the latest earlier match of the longest suffix."""
        for n in range(min(self.max_ngram, len(sequence) - 1), 0, -1):
            suffix = sequence[-n:]
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start : start + n] == suffix:
                    return sequence[start + n : start + n + g]
        return []

"""Repetition penalties on the device: each penalised lane's tokens so far as a [V] mask.

A CTRL-style penalty divides a seen token's logit by the penalty when it is positive and
multiplies it when negative. Keeping what a lane has seen as a boolean mask on the
device, grown by the few tokens each round adds, costs the host nothing per step however
long the context, and lets a pipelined round penalise the token the round before chose
while that token is still on the device.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from .lane import Lane

_TRUE = mx.array(True)


def penalize(logits: mx.array, seen: mx.array, penalties: list[float]) -> mx.array:
    """[R, V] logits with row r's `seen[r]` tokens penalised by `penalties[r]` (new array)."""
    p = mx.array(penalties, dtype=logits.dtype)[:, None]
    return mx.where(seen, mx.where(logits > 0, logits / p, logits * p), logits)


def mark(seen: mx.array, rows: list[int] | mx.array, tokens: list[int] | mx.array) -> mx.array:
    """`seen` [R, V] with token `tokens[i]` marked in row `rows[i]` (new array)."""
    return seen.at[mx.array(rows) if isinstance(rows, list) else rows,
                   mx.array(tokens) if isinstance(tokens, list) else tokens].maximum(_TRUE)


def with_drafts_before(seen: mx.array, fed: mx.array, windows: list[tuple[int, int]]) -> mx.array:
    """`seen [R, V]`, what each verify row's lane has seen, with what the row has seen in
    its own window too: for each window `(start, rows)` of the fed rows `fed [R]` (anchor,
    then drafts), row start + k sees drafts start + 1 .. start + k (new array)."""
    rows, fed_index = [], []
    for start, count in windows:
        for k in range(1, count):
            rows += [start + k] * k
            fed_index += range(start + 1, start + 1 + k)
    return mark(seen, rows, fed[mx.array(fed_index, dtype=mx.int32)]) if rows else seen


class SeenTokens:
    """Each penalised lane's prompt and generated tokens as a [V] boolean mask, folded in
    as the lane grows. Lanes are held weakly: a finished lane's mask goes with it."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._masks: weakref.WeakKeyDictionary[Lane, tuple[mx.array, int]] = weakref.WeakKeyDictionary()

    def of(self, lane: Lane) -> mx.array:
        """[V]: the tokens of `lane`'s prompt and of what it has generated so far."""
        mask, folded = self._masks.get(lane, (None, 0))
        if mask is None:
            mask = mx.zeros((self.vocab,), dtype=mx.bool_)
        prompt = lane.request.prompt
        new = prompt[folded:] + lane.generated if folded < len(prompt) else lane.generated[folded - len(prompt) :]
        if new:
            mask = mask.at[mx.array(new)].maximum(_TRUE)
            self._masks[lane] = (mask, folded + len(new))
        return mask

    def rows(self, lanes: list[Lane], widths: list[int] | None = None) -> mx.array:
        """[sum(widths), V]: lane i's mask repeated over its `widths[i]` rows (one each by
        default); lanes without a penalty get empty rows."""
        empty = mx.zeros((self.vocab,), dtype=mx.bool_)
        masks = [self.of(lane) if lane.request.sampling.repetition_penalty != 1.0 else empty for lane in lanes]
        if widths is not None:
            masks = [m for m, w in zip(masks, widths) for _ in range(w)]
        return mx.stack(masks)

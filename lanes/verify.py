"""Verifying drafts against the target's rows.

Greedy and sampled lanes follow one rule: the target's own choice at each row (argmax,
or the seeded Gumbel-max draw of `sampling.choose`) is computed for every verified row
in one lazy batch, read back in one host sync, and a lane keeps its drafts while each
equals the target's choice on the row before it. The emitted tokens are then exactly
the choices of rows 0..accepted: the plain run's tokens, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .acceptance import greedy_accept_length
from .logprobs import TokenLogprob, logprob_arrays, read_logprobs
from .penalty import penalize
from .sampling import SamplingParams, choose, row_keys

PADDING = SamplingParams()  # rows past a window: chosen greedily, never read


@dataclass
class Window:
    """One lane's rows in a verify forward: the anchor and `drafts` (possibly none)."""

    params: SamplingParams
    seed: int
    position: int  # absolute position of the anchor
    drafts: list[int]
    logprobs: int | None = None  # top alternatives wanted per emitted token (None: no logprobs)

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts)

    def keys(self) -> list[int]:
        """Noise keys of the tokens each row decides (row k decides position + 1 + k)."""
        return row_keys(self.seed, self.params, self.position + 1, self.rows)


@dataclass
class Outcome:
    accepted: int  # drafts kept
    tokens: list[int]  # what the lane emits: the kept drafts, then the target's own token
    logprobs: list[TokenLogprob] | None = None


def verify(logits: mx.array, row_starts: list[int], windows: list[Window], seen: mx.array | None = None) -> list[Outcome]:
    """Accept each lane's drafts from the target's `logits` [rows, V] (lane i's rows begin
    at `row_starts[i]`). Choices are made for every row, padding rows too (as greedy
    rows), so the round's shapes stay steady; padding rows are never read. `seen` [rows,
    V] marks what each row has seen, where a lane has a repetition penalty."""
    total = logits.shape[0]
    params, keys, wanted = [PADDING] * total, [0] * total, [None] * total
    for start, w in zip(row_starts, windows):
        span = slice(start, start + w.rows)
        params[span], keys[span], wanted[span] = [w.params] * w.rows, w.keys(), [w.logprobs] * w.rows
    target = logits if seen is None else penalize(logits, seen, [p.repetition_penalty for p in params])
    choices = choose(target, params, keys)
    lp = logprob_arrays(logits, choices, wanted)
    mx.eval(choices, *lp)
    chosen = choices.tolist()
    per_row = read_logprobs(lp, chosen, wanted)

    outcomes = []
    for start, w in zip(row_starts, windows):
        mine = chosen[start : start + w.rows]
        accepted = greedy_accept_length(w.drafts, mine)
        logprobs = per_row[start : start + accepted + 1] if w.logprobs is not None else None
        outcomes.append(Outcome(accepted, mine[: accepted + 1], logprobs))
    return outcomes

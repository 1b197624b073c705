"""Verifying drafts against the target's rows.

Greedy and sampled lanes follow one rule: the target's own choice at each row (argmax,
or the seeded Gumbel-max draw of `sampling.choose`) is computed for every row, and a
lane keeps its drafts while each equals the target's choice on the row before it. Both
are computed on the device, from drafts the host has not read, and read back together
in the round's one host sync. The emitted tokens are exactly the choices of rows
0..accepted: the plain run's tokens, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .logprobs import TokenLogprob, logprob_arrays, read_logprobs
from .penalty import penalize
from .sampling import SamplingParams, choose, row_keys

PADDING = SamplingParams()  # rows past a window: chosen greedily, never read


@dataclass
class Window:
    """One lane's rows in a verify forward: the anchor and `depth` drafts (possibly none)."""

    params: SamplingParams
    seed: int
    position: int  # absolute position of the anchor
    depth: int
    logprobs: int | None = None  # top alternatives wanted per emitted token (None: no logprobs)

    @property
    def rows(self) -> int:
        return 1 + self.depth

    def keys(self) -> list[int]:
        """Noise keys of the tokens each row decides (row k decides position + 1 + k)."""
        return row_keys(self.seed, self.params, self.position + 1, self.rows)


@dataclass
class Outcome:
    accepted: int  # drafts kept
    tokens: list[int]  # what the lane emits: the kept drafts, then the target's own token
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Verdict:
    """A verify forward's decisions, lazily evaluated: read them with `outcomes`."""

    choices: mx.array  # [N, W] the target's choice at every row
    accepted: mx.array  # [N] drafts kept per lane
    logprobs: list[mx.array]
    wanted: list[int | None]  # per row

    def arrays(self) -> list[mx.array]:
        return [self.choices, self.accepted, *self.logprobs]

    def outcomes(self, windows: list[Window], refused: list[bool]) -> list[Outcome]:
        """Each lane's outcome, from the evaluated arrays. A `refused` lane (its proposal
        was faulty) keeps no draft: its row 0 never depended on them."""
        chosen, accepted = self.choices.tolist(), self.accepted.tolist()
        width = len(chosen[0])
        per_row = read_logprobs(self.logprobs, [t for row in chosen for t in row], self.wanted)
        outcomes = []
        for i, (w, row) in enumerate(zip(windows, chosen)):
            kept = 0 if refused[i] else accepted[i]
            logprobs = per_row[i * width : i * width + kept + 1] if w.logprobs is not None else None
            outcomes.append(Outcome(kept, row[: kept + 1], logprobs))
        return outcomes


def verify(logits: mx.array, fed: mx.array, windows: list[Window], seen: mx.array | None = None) -> Verdict:
    """The target's choice at every row of a verify forward and each lane's accepted
    drafts, on the device. `logits` [N * W, V] and `fed` [N, W] (the anchor, then the
    drafts, then padding) hold W rows per lane; lane i's drafts past `windows[i].depth`
    are padding and never kept. Padding rows are chosen greedily and never read. `seen`
    [N * W, V] marks what each row has seen, where a lane has a repetition penalty."""
    n, width = fed.shape
    params, keys, wanted = [PADDING] * (n * width), [0] * (n * width), [None] * (n * width)
    for i, w in enumerate(windows):
        span = slice(i * width, i * width + w.rows)
        params[span], keys[span], wanted[span] = [w.params] * w.rows, w.keys(), [w.logprobs] * w.rows
    target = logits if seen is None else penalize(logits, seen, [p.repetition_penalty for p in params])
    choices = choose(target, params, keys)
    lp = logprob_arrays(logits, choices, wanted)
    choices = choices.reshape(n, width)
    # A draft is kept while it equals the choice on the row before it, up to the lane's depth.
    depth = mx.array([w.depth for w in windows], dtype=mx.int32)[:, None]
    matches = (fed[:, 1:] == choices[:, :-1]) & (mx.arange(width - 1, dtype=mx.int32)[None, :] < depth)
    accepted = mx.cumprod(matches.astype(mx.int32), axis=1).sum(axis=1)
    return Verdict(choices, accepted, lp, wanted)

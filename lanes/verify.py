"""Verifying drafts against the target's rows.

Greedy and sampled lanes follow one rule: the target's own choice at each row (argmax,
or the seeded Gumbel-max draw of `sampling.choose`) is computed for every verified row
in one lazy batch, read back in the round's one host sync, and a lane keeps its drafts
while each equals the target's choice on the row before it. The emitted tokens are then exactly
the choices of rows 0..accepted: the plain run's tokens, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .acceptance import greedy_accept_length
from .logprobs import TokenLogprob, logprob_arrays, read_logprobs
from .penalty import penalize
from .sampling import SamplingParams, choose, row_keys

PADDING = SamplingParams()  # rows past a window: chosen greedily, never read


@dataclass
class Window:
    """One lane's rows in a verify forward: the anchor and `depth` drafts (possibly none).
    `drafts` are the drafts as the host knows them: all `depth` before the forward, or
    filled in when the forward's results are read (drafts fed to it on the device); an
    unusable proposal leaves none, so nothing of it is kept."""

    params: SamplingParams
    seed: int
    position: int  # absolute position of the anchor
    depth: int
    logprobs: int | None = None  # top alternatives wanted per emitted token (None: no logprobs)
    drafts: list[int] = field(default_factory=list)

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
class RowChoices:
    """The target's own choice on every row of a verify forward, and the logprobs lanes
    asked for, lazily: evaluate `arrays()` (with whatever else the round reads), then
    `accept`."""

    row_starts: list[int]
    windows: list[Window]
    choices: mx.array  # [rows] int32
    logprobs: list[mx.array]
    wanted: list[int | None]  # per row

    def arrays(self) -> list[mx.array]:
        return [self.choices, *self.logprobs]

    def accept(self) -> list[Outcome]:
        """Each lane's outcome: it keeps its drafts while each equals the target's choice
        on the row before it, and emits the choices of rows 0..accepted."""
        chosen = self.choices.tolist()
        per_row = read_logprobs(self.logprobs, chosen, self.wanted)
        outcomes = []
        for start, w in zip(self.row_starts, self.windows):
            mine = chosen[start : start + w.rows]
            accepted = greedy_accept_length(w.drafts, mine)
            logprobs = per_row[start : start + accepted + 1] if w.logprobs is not None else None
            outcomes.append(Outcome(accepted, mine[: accepted + 1], logprobs))
        return outcomes


def row_choices(logits: mx.array, row_starts: list[int], windows: list[Window], seen: mx.array | None = None) -> RowChoices:
    """The target's choices from its `logits` [rows, V] (lane i's rows begin at
    `row_starts[i]`), lazily. Choices are made for every row, padding rows too (as greedy
    rows), so the round's shapes stay steady; padding rows are never read. `seen` [rows,
    V] marks what each row has seen, where a lane has a repetition penalty."""
    total = logits.shape[0]
    params, keys, wanted = [PADDING] * total, [0] * total, [None] * total
    for start, w in zip(row_starts, windows):
        span = slice(start, start + w.rows)
        params[span], keys[span], wanted[span] = [w.params] * w.rows, w.keys(), [w.logprobs] * w.rows
    target = logits if seen is None else penalize(logits, seen, [p.repetition_penalty for p in params])
    choices = choose(target, params, keys)
    return RowChoices(row_starts, windows, choices, logprob_arrays(logits, choices, wanted), wanted)


def accepted_on_device(fed: mx.array, choices: mx.array, depths: list[int]) -> mx.array:
    """`greedy_accept_length` for every lane at once, on the device (lazy): from the rows
    each lane fed `[N, W]` (anchor, then drafts and padding) and the target's choice on
    each `[N, W]`, the drafts each lane keeps `[N]`: the longest run of drafts that equal
    the choice on the row before them, at most the lane's priced `depths`."""
    drafts = fed.shape[1] - 1
    if drafts == 0:
        return mx.zeros((fed.shape[0],), dtype=mx.int32)
    # The run ends at the first draft that differs from its choice (none: every draft).
    first_miss = mx.where(fed[:, 1:] == choices[:, :-1], drafts, mx.arange(drafts, dtype=mx.int32)).min(axis=1)
    return mx.minimum(first_miss, mx.array(depths, dtype=mx.int32))

"""Acceptance rules for verify windows: which drafts the target keeps (lossless).

Greedy and sampled lanes share one rule: a draft is kept exactly when it equals the
target's own choice (its argmax, or its seeded Gumbel-max draw) on the row before it.

Indexing: in a window of drafts x_1..x_d (index k = 0..d-1 here), the target's row
before draft k is the row whose output decides x_k.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx


def greedy_accept_length(drafts: Sequence[int], target_choices: Sequence[int]) -> int:
    """Length of the longest prefix where drafts[k] == target_choices[k], the target's
    argmax on the row before draft k."""
    if len(target_choices) < len(drafts):
        raise ValueError(f"{len(target_choices)} target choices for {len(drafts)} drafts")
    accepted = 0
    for draft, choice in zip(drafts, target_choices):
        if draft != choice:
            break
        accepted += 1
    return accepted


def accept_lengths(fed: mx.array, choices: mx.array, row_starts: Sequence[int], depths: Sequence[int]) -> mx.array:
    """`greedy_accept_length` for every lane of a verify forward, on the device `[N]`
    (lazy): lane i's drafts are the fed rows after its anchor (`fed[start + 1 + k]`,
    its first `depths[i]`), each kept while it equals the choice on the row before it
    (`choices[start + k]`)."""
    most = max(depths, default=0)
    if most == 0:
        return mx.zeros((len(depths),), dtype=mx.int32)
    before = mx.array([[start + min(k, max(d - 1, 0)) for k in range(most)] for start, d in zip(row_starts, depths)], dtype=mx.int32)
    within = mx.array([[k < d for k in range(most)] for d in depths])
    kept = (fed[before + 1] == choices[before]) & within
    return mx.cumprod(kept.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)

"""Acceptance rules for verify windows: which drafts the target keeps (lossless).

Greedy and sampled lanes share one rule: a draft is kept exactly when it equals the
target's own choice (its argmax, or its seeded Gumbel-max draw) on the row before it.

Indexing: in a window of drafts x_1..x_d (index k = 0..d-1 here), the target's row
before draft k is the row whose output decides x_k.
"""

from __future__ import annotations

from collections.abc import Sequence


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

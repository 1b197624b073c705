"""Acceptance rules for verify windows: which drafts the target keeps (lossless).

Indexing: in a window of drafts x_1..x_d (index k = 0..d-1 here), the target's row
before draft k is the row whose output decides x_k.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class InvalidDraftProbability(ValueError):
    """A sampled draft's drafter probability q is not positive (or is NaN): the drafter
    could not have sampled it, so q is not the distribution the draft came from."""


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


def rejection_accept_length(
    p_of_drafts: Sequence[float],
    q_of_drafts: Sequence[float],
    uniforms: Sequence[float],
) -> int:
    """Speculative rejection sampling: accept draft x_k while uniforms[k] < min(1, p/q),
    where p and q are the target's and the drafter's probabilities of x_k (q being the
    distribution the drafter actually sampled from). Returns how many were accepted."""
    if not len(p_of_drafts) == len(q_of_drafts) <= len(uniforms):
        raise ValueError(
            f"need as many p as q and at least as many uniforms: "
            f"{len(p_of_drafts)}, {len(q_of_drafts)}, {len(uniforms)}"
        )
    accepted = 0
    for k, (p, q, u) in enumerate(zip(p_of_drafts, q_of_drafts, uniforms)):
        if not q > 0.0:
            raise InvalidDraftProbability(f"draft {k} has drafter probability {q}")
        if not 0.0 <= p < math.inf:
            raise ValueError(f"draft {k} has target probability {p}")
        if not u < min(1.0, p / q):
            break
        accepted += 1
    return accepted


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """normalize(max(0, p - q)) over the last axis: what to sample from after rejecting
    a draft drawn from q, so that the emitted token is distributed exactly as p.

    Where the residual is all zero, p <= q everywhere, which for two distributions means
    p == q: rejection then had probability zero and can only come from rounding, and
    since p == q, sampling from p (normalized) is the exact answer.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"p and q differ in shape: {p.shape} vs {q.shape}")
    residual = np.maximum(p - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    degenerate = mass <= 0.0
    residual = np.where(degenerate, p, residual)
    mass = np.where(degenerate, p.sum(axis=-1, keepdims=True), mass)
    return residual / mass

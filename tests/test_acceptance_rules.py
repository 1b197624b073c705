"""Acceptance rules: greedy prefix match, speculative rejection sampling, the residual."""

import numpy as np
import pytest

from lanes.acceptance import (
    InvalidDraftProbability,
    greedy_accept_length,
    rejection_accept_length,
    residual_distribution,
)


def test_greedy_accepts_the_matching_prefix():
    assert greedy_accept_length([5, 6, 7], [5, 6, 9, 1]) == 2  # 7 != 9
    assert greedy_accept_length([5, 6, 7], [5, 6, 7, 8]) == 3  # all match; 8 is the bonus row
    assert greedy_accept_length([5, 6, 7], [4, 6, 7, 8]) == 0  # later matches do not count
    assert greedy_accept_length([], [3]) == 0
    with pytest.raises(ValueError):
        greedy_accept_length([5, 6], [5])


def test_rejection_hand_cases():
    # k=0: p/q = 0.5/0.25 = 2 -> min 1; u 0.99 < 1 accept.
    # k=1: p/q = 0.2/0.4 = 0.5; u 0.6 >= 0.5 reject -> 1 accepted.
    assert rejection_accept_length([0.5, 0.2, 0.9], [0.25, 0.4, 0.3], [0.99, 0.6, 0.1]) == 1
    # k=1 with u 0.4 < 0.5 accept; k=2: p/q = 3 -> min 1; u 0.1 accept -> 3.
    assert rejection_accept_length([0.5, 0.2, 0.9], [0.25, 0.4, 0.3], [0.99, 0.4, 0.1]) == 3
    # u equal to the ratio rejects (u < ratio); p = 0 rejects even u = 0.
    assert rejection_accept_length([0.2], [0.4], [0.5]) == 0
    assert rejection_accept_length([0.0], [0.4], [0.0]) == 0
    # Extra uniforms (e.g. the one for the bonus token) are ignored.
    assert rejection_accept_length([0.3], [0.3], [0.5, 0.7]) == 1


def test_rejection_refuses_impossible_drafts():
    with pytest.raises(InvalidDraftProbability):
        rejection_accept_length([0.5, 0.5], [0.5, 0.0], [0.1, 0.1])
    with pytest.raises(InvalidDraftProbability):
        rejection_accept_length([0.5], [float("nan")], [0.1])
    assert issubclass(InvalidDraftProbability, ValueError)
    with pytest.raises(ValueError):
        rejection_accept_length([float("nan")], [0.5], [0.1])
    with pytest.raises(ValueError):
        rejection_accept_length([0.5, 0.5], [0.5], [0.1, 0.1])
    with pytest.raises(ValueError):
        rejection_accept_length([0.5, 0.5], [0.5, 0.5], [0.1])


def test_residual_hand_cases():
    # max(0, p - q) = [0.3, 0.1, 0] -> / 0.4
    assert residual_distribution([0.4, 0.4, 0.2], [0.1, 0.3, 0.6]) == pytest.approx([0.75, 0.25, 0.0])
    assert residual_distribution([0.5, 0.3, 0.2], [0.2, 0.5, 0.3]) == pytest.approx([1.0, 0.0, 0.0])


def test_residual_falls_back_to_p_when_p_equals_q():
    p = np.array([0.2, 0.3, 0.5])
    assert residual_distribution(p, p) == pytest.approx(p)
    batch = residual_distribution([[0.4, 0.4, 0.2], [0.2, 0.3, 0.5]], [[0.1, 0.3, 0.6], [0.2, 0.3, 0.5]])
    assert batch == pytest.approx(np.array([[0.75, 0.25, 0.0], [0.2, 0.3, 0.5]]))
    with pytest.raises(ValueError):
        residual_distribution([0.5, 0.5], [1.0])


def test_accept_or_resample_reproduces_p_exactly():
    # One position: the token is x ~ q kept with chance min(1, p/q), else drawn from the
    # residual. Its law is min(p, q) + (1 - sum(min(p, q))) * residual, which must be p.
    rng = np.random.default_rng(0)
    for _ in range(100):
        p = rng.dirichlet(np.full(12, 0.5))
        q = rng.dirichlet(np.full(12, 0.5))
        kept = np.minimum(p, q)
        law = kept + (1.0 - kept.sum()) * residual_distribution(p, q)
        assert law == pytest.approx(p, abs=1e-12)


def test_rejection_accepts_at_the_rate_sum_min_p_q():
    # Draws x ~ q and runs the rule on one position: the acceptance rate is sum(min(p, q)).
    rng = np.random.default_rng(1)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    draws = rng.choice(4, size=20_000, p=q)
    uniforms = rng.random(draws.size)
    accepted = [rejection_accept_length([p[x]], [q[x]], [u]) for x, u in zip(draws, uniforms)]
    rate = np.minimum(p, q).sum()  # 0.1 + 0.2 + 0.15 + 0.05 = 0.5
    assert np.mean(accepted) == pytest.approx(rate, abs=4 * np.sqrt(rate * (1 - rate) / draws.size))

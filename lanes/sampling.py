"""Sampling on device: the filtered distribution of a row, and draws from it.

Every row carries its own parameters, so one batch of ops serves all lanes of a round.
The same filter shapes the target's p and the drafter's q, which is what keeps
speculative rejection sampling lossless. Draws use inverse-CDF sampling with one host
uniform per row, taken from the lane's own counter-based stream (`lane_uniform`), so a
lane's randomness never depends on which other lanes share its round.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Purposes of a lane's uniforms, so no two decisions at one position share a draw.
SAMPLE, ACCEPT, RESIDUAL, DRAFT = range(4)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not (self.repetition_penalty > 0 and np.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def lane_uniform(seed: int, position: int, purpose: int, index: int = 0) -> float:
    """A uniform in [0, 1) fixed by (seed, position, purpose, index): counter-based, so the
    draw for a token depends on nothing but the lane's own request and the token's place."""
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, position, purpose, index]).random())


def apply_repetition_penalty(logits: mx.array, histories: list[list[int]], penalties: list[float]) -> mx.array:
    """CTRL-style penalty: a seen token's logit is divided by the penalty when positive and
    multiplied when negative. Row r penalises the tokens in `histories[r]`."""
    rows, cols = [], []
    factors = []
    for r, (seen, penalty) in enumerate(zip(histories, penalties)):
        if penalty == 1.0 or not seen:
            continue
        unique = sorted(set(seen))
        rows += [r] * len(unique)
        cols += unique
        factors += [penalty] * len(unique)
    if not rows:
        return logits
    rows_a, cols_a = mx.array(rows), mx.array(cols)
    picked = logits[rows_a, cols_a]
    factor = mx.array(factors, dtype=logits.dtype)
    logits[rows_a, cols_a] = mx.where(picked > 0, picked / factor, picked * factor)
    return logits


def filtered_logprobs(logits: mx.array, params: list[SamplingParams]) -> mx.array:
    """[R, V] logits -> [R, V] log-probabilities after temperature, top-k, top-p and min-p
    (filtered tokens at -inf). Row r uses `params[r]`; greedy rows come back at T=1."""
    x = logits.astype(mx.float32)
    temperature = mx.array([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
    x = x / temperature
    vocab = x.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        descending = -mx.sort(-x, axis=-1)
        if min(top_k) < vocab:
            kth = mx.take_along_axis(descending, mx.array(top_k)[:, None] - 1, axis=-1)
            x = mx.where(x >= kth, x, -mx.inf)
            descending = mx.where(descending >= kth, descending, -mx.inf)
        if min(top_p) < 1.0:
            # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
            mass = mx.cumsum(mx.softmax(descending, axis=-1), axis=-1)
            before = mass - mx.softmax(descending, axis=-1)
            cutoff = mx.min(mx.where(before < mx.array(top_p)[:, None], descending, mx.inf), axis=-1, keepdims=True)
            x = mx.where(x >= cutoff, x, -mx.inf)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    min_p = [p.min_p for p in params]
    if max(min_p) > 0:
        floor = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.maximum(mx.array(min_p)[:, None], 1e-30))
        x = mx.where(logprobs >= floor, logprobs, -mx.inf)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    return logprobs


def draw(probs: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse-CDF draws: row r takes the first token whose cumulative mass exceeds u_r."""
    cdf = mx.cumsum(probs, axis=-1)
    u = uniforms[:, None] * cdf[:, -1:]
    return mx.minimum(mx.sum(cdf <= u, axis=-1), probs.shape[-1] - 1).astype(mx.int32)

"""Sampling on device: the filtered distribution of a row, and exact seeded draws from it.

Every row carries its own parameters, so one batch of ops serves all lanes of a round.

A sampled token is a deterministic function of (the request's seed, the token's
position, the target's filtered distribution there): Gumbel-max, token =
argmax(log p + g) with g drawn from a counter-based hash keyed by (seed, position) over
the vocabulary. Its law is exactly p. The drafter proposes with the same noise over its
own distribution, and a draft is kept exactly when it equals the target's own draw at
its position, as in greedy; so drafted output equals plain output token for token at
every temperature, whoever shares the round and whatever the guards decide.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # spreads consecutive vocabulary indices over the hash's input


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


# ---- the counter-based noise ---------------------------------------------------------


def mix32(x: int) -> int:
    """A 32-bit integer hash with full avalanche (lowbias32), on the host."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def _mix32_device(x: mx.array) -> mx.array:
    """`mix32` on uint32 arrays (products wrap modulo 2^32, as on the host)."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, dtype=mx.uint32)
    return x ^ (x >> 16)


def noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the noise for the token at `position` of a request seeded `seed`."""
    seed &= 0xFFFFFFFFFFFFFFFF
    return mix32((seed & _MASK32) ^ mix32((seed >> 32) ^ mix32(position)))


def noise_keys_on_device(seeds: list[int], positions: mx.array) -> mx.array:
    """`noise_key(seeds[i], positions[i, k])` for positions only the device knows (a round
    built on lengths the host has not read): uint32 `[N, K]`, the host's keys exactly."""
    seeds = [s & 0xFFFFFFFFFFFFFFFF for s in seeds]
    low = mx.array([s & _MASK32 for s in seeds], dtype=mx.uint32)[:, None]
    high = mx.array([s >> 32 for s in seeds], dtype=mx.uint32)[:, None]
    return _mix32_device(low ^ _mix32_device(high ^ _mix32_device(positions.astype(mx.uint32))))


def gumbel_noise(keys: list[int] | mx.array, vocab: int) -> mx.array:
    """[R, V] standard Gumbel noise, row r keyed by `keys[r]` (see `noise_key`; a uint32
    array from `noise_keys_on_device` too): the same key gives the same noise on every
    backend, since it is integer arithmetic up to the final float transform."""
    key = (keys.astype(mx.uint32) if isinstance(keys, mx.array) else mx.array(keys, dtype=mx.uint32))[:, None]
    index = mx.arange(vocab, dtype=mx.uint32)[None, :] * mx.array(_GOLDEN, dtype=mx.uint32)
    bits = _mix32_device(_mix32_device(key ^ index) + key)
    # 23 random bits -> v uniform strictly inside (0, 1), every value exact in float32;
    # with u = 1 - v, the Gumbel -log(-log u) is spelled with log1p so that float32 keeps
    # its upper tail (u near 1) accurate.
    v = (bits >> 9).astype(mx.float32) * (2.0**-23) + 2.0**-24
    return -mx.log(-mx.log1p(-v))


# ---- filtering and drawing -----------------------------------------------------------


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


def choose(logits: mx.array, params: list[SamplingParams], keys: list[int] | mx.array) -> mx.array:
    """One token per row (lazy): argmax for greedy rows; for the others the Gumbel-max draw
    argmax(log p + g) from the filtered distribution p, with noise keyed by `keys[r]`
    (ignored for greedy rows)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(p.greedy for p in params):
        return greedy
    noisy = filtered_logprobs(logits, params) + gumbel_noise(keys, logits.shape[-1])
    sampled = mx.argmax(noisy, axis=-1).astype(mx.int32)
    return mx.where(mx.array([p.greedy for p in params]), greedy, sampled)


def row_keys(seed: int, params: SamplingParams, first_position: int, rows: int) -> list[int]:
    """The noise keys of `rows` consecutive tokens from `first_position` (zeros for greedy
    lanes, which draw no noise: no host work per step for them)."""
    if params.greedy:
        return [0] * rows
    return [noise_key(seed, first_position + k) for k in range(rows)]

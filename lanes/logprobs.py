"""Log-probabilities of emitted tokens, for clients that ask for them.

They are the target's raw distribution at the row that chose the token (log_softmax of
its logits, before temperature, penalties and filters), as vLLM reports them by default.
Computed lazily with the round's choices and read in the same host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the best alternatives, best first


def logprob_arrays(logits: mx.array, tokens: mx.array, wanted: list[int | None]) -> list[mx.array]:
    """Lazy arrays for `read_logprobs`: each row's log-probability of its token and of its
    `max(wanted)` most likely tokens. Nothing when no row wants logprobs."""
    asked = [k for k in wanted if k is not None]
    if not asked:
        return []
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens.astype(mx.int32)[:, None], axis=-1)[:, 0]
    k = max(asked)
    if k == 0:
        return [chosen]
    best = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, best, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return [chosen, mx.take_along_axis(best, order, axis=-1), mx.take_along_axis(values, order, axis=-1)]


def read_logprobs(arrays: list[mx.array], tokens: list[int], wanted: list[int | None]) -> list[TokenLogprob | None]:
    """Host values of evaluated `logprob_arrays`, one entry per row (None where not wanted)."""
    if not arrays:
        return [None] * len(wanted)
    chosen = arrays[0].tolist()
    ids, values = (arrays[1].tolist(), arrays[2].tolist()) if len(arrays) == 3 else ([], [])
    out: list[TokenLogprob | None] = []
    for r, (token, k) in enumerate(zip(tokens, wanted)):
        if k is None:
            out.append(None)
            continue
        top = list(zip(ids[r][:k], values[r][:k])) if k else []
        out.append(TokenLogprob(token, chosen[r], top))
    return out

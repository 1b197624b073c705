"""Verifying drafts against the target's rows: greedy exact match and lossless
speculative rejection sampling.

Everything a lane's acceptance needs is computed on device in one lazy batch (the
target's choice or filtered probabilities at every verified row, the drafter's
probabilities of its drafts, a residual draw at every row and a bonus draw at the last)
and read back in one host sync; the accept/reject arithmetic then runs on the host with
the pure rules of `acceptance.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .acceptance import greedy_accept_length, rejection_accept_length
from .sampling import ACCEPT, DRAFT, RESIDUAL, SAMPLE, SamplingParams, apply_repetition_penalty, draw, filtered_logprobs, lane_uniform


@dataclass
class Window:
    """One lane's rows in a verify forward: the anchor and `drafts` (possibly none)."""

    params: SamplingParams
    seed: int
    position: int  # absolute position of the anchor
    history: list[int]  # prompt + generated, for the repetition penalty
    drafts: list[int]
    draft_row: int | None = None  # this lane's row in the proposal (chain logits), when drafted

    @property
    def rows(self) -> int:
        return 1 + len(self.drafts)

    def row_histories(self) -> list[list[int]]:
        return [self.history + self.drafts[:k] for k in range(self.rows)]


@dataclass
class Outcome:
    accepted: int  # drafts kept
    token: int  # the target's own token after them (correction or bonus)


def draft_picker(params: list[SamplingParams], seeds: list[int], positions: list[int], width: int):
    """The drafter's `pick(logits, k)`: argmax for greedy lanes, a draw from the filtered
    chain distribution for sampling lanes with the lane's own DRAFT uniforms."""
    if all(p.greedy for p in params):
        return None
    uniforms = mx.array(
        [[lane_uniform(s, pos + 1 + k, DRAFT) for k in range(width)] for s, pos in zip(seeds, positions)], dtype=mx.float32
    )
    greedy = mx.array([p.greedy for p in params])

    def pick(logits: mx.array, k: int) -> mx.array:
        sampled = draw(mx.exp(filtered_logprobs(logits, params)), uniforms[:, k])
        return mx.where(greedy, mx.argmax(logits, axis=-1).astype(mx.int32), sampled)

    return pick


def verify(logits: mx.array, row_starts: list[int], windows: list[Window], chain_logits: mx.array | None) -> list[Outcome]:
    """Accept each lane's drafts from the target's `logits` [rows, V] (lane i's rows begin
    at `row_starts[i]`). `chain_logits` [N, g, V] are the drafter's Markov-corrected
    logits, the distribution sampled drafts were drawn from."""
    greedy = [i for i, w in enumerate(windows) if w.params.greedy]
    sampled = [i for i, w in enumerate(windows) if not w.params.greedy]
    lazy: dict[int, list[mx.array]] = {}
    greedy_rows = [row_starts[i] + k for i in greedy for k in range(windows[i].rows)]
    penalised = any(windows[i].params.repetition_penalty != 1.0 for i in greedy)
    if penalised:
        histories = [h for i in greedy for h in windows[i].row_histories()]
        penalties = [windows[i].params.repetition_penalty for i in greedy for _ in range(windows[i].rows)]
        chosen = apply_repetition_penalty(logits[mx.array(greedy_rows, dtype=mx.int32)], histories, penalties)
        lazy["greedy"] = [mx.argmax(chosen, axis=-1)]
    elif greedy:
        # Every row's argmax, padding rows too, picked on the host: one steady shape.
        lazy["greedy"] = [mx.argmax(logits, axis=-1)]
    for i in sampled:
        lazy[i] = _sampling_tensors(logits, row_starts[i], windows[i], chain_logits)
    mx.eval([a for arrays in lazy.values() for a in arrays])

    outcomes: list[Outcome | None] = [None] * len(windows)
    if greedy:
        choices = lazy["greedy"][0].tolist()
        if not penalised:
            choices = [choices[r] for r in greedy_rows]
        offset = 0
        for i in greedy:
            w = windows[i]
            mine = choices[offset : offset + w.rows]
            offset += w.rows
            accepted = greedy_accept_length(w.drafts, mine)
            outcomes[i] = Outcome(accepted, mine[accepted])
    for i in sampled:
        outcomes[i] = _sampled_outcome(windows[i], *(a.tolist() for a in lazy[i]))
    return outcomes


def _sampling_tensors(logits: mx.array, start: int, w: Window, chain_logits: mx.array | None) -> list[mx.array]:
    """p(x_k), q(x_k), a residual draw at every draft row and the bonus draw at the last row."""
    target = logits[start : start + w.rows]
    if w.params.repetition_penalty != 1.0:
        target = apply_repetition_penalty(target, w.row_histories(), [w.params.repetition_penalty] * w.rows)
    p = mx.exp(filtered_logprobs(target, [w.params] * w.rows))
    last = w.rows - 1
    bonus = draw(p[last:], mx.array([lane_uniform(w.seed, w.position + w.rows, SAMPLE)]))
    if not w.drafts:
        return [bonus]
    d = len(w.drafts)
    q = mx.exp(filtered_logprobs(chain_logits[w.draft_row, :d], [w.params] * d))
    drafts = mx.array(w.drafts, dtype=mx.int32)[:, None]
    p_x = mx.take_along_axis(p[:d], drafts, axis=-1)[:, 0]
    q_x = mx.take_along_axis(q, drafts, axis=-1)[:, 0]
    residual = mx.maximum(p[:d] - q, 0.0)
    # Where p <= q everywhere the residual is empty; rejection there can only come from
    # rounding, and p itself is then the exact answer (see acceptance.residual_distribution).
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, p[:d], residual)
    uniforms = mx.array([lane_uniform(w.seed, w.position + 1 + k, RESIDUAL) for k in range(d)], dtype=mx.float32)
    return [bonus, p_x, q_x, draw(residual, uniforms)]


def _sampled_outcome(w: Window, bonus: list[int], p_x=None, q_x=None, residuals=None) -> Outcome:
    if not w.drafts:
        return Outcome(0, bonus[0])
    uniforms = [lane_uniform(w.seed, w.position + 1 + k, ACCEPT) for k in range(len(w.drafts))]
    accepted = rejection_accept_length(p_x, q_x, uniforms)
    token = bonus[0] if accepted == len(w.drafts) else residuals[accepted]
    return Outcome(accepted, token)

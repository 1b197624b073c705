"""One shared round over every decoding lane, and the prefill that precedes it.

A round: decide whether drafting pays (the guard), draft for the drafting lanes in one
batched drafter forward, price their verify windows before the target runs, verify every
lane's rows in one target forward, accept per lane, commit (KV trim, conv rebuild,
drafter context append of anchor + accepted rows), emit, and record what the round cost.
"""

from __future__ import annotations

import mlx.core as mx

from .lane import Lane, LaneEvent
from .sampling import SAMPLE, SamplingParams, apply_repetition_penalty, draw, filtered_logprobs, lane_uniform


def choose_tokens(logits: mx.array, params: list[SamplingParams], histories: list[list[int]], uniforms: list[float]) -> mx.array:
    """One token per row: argmax for greedy rows, an inverse-CDF draw from the filtered
    distribution for the others (lazy; the caller evaluates)."""
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = apply_repetition_penalty(logits, histories, [p.repetition_penalty for p in params])
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if all(p.greedy for p in params):
        return greedy
    sampled = draw(mx.exp(filtered_logprobs(logits, params)), mx.array(uniforms, dtype=mx.float32))
    return mx.where(mx.array([p.greedy for p in params]), greedy, sampled)


class RoundRunner:
    def __init__(self, target, drafter=None, draft_width: int | None = None):
        self.target = target
        self.drafter = drafter
        self.draft_width = draft_width

    def prefill(self, lane: Lane, chunk: list[int]) -> mx.array:
        """Read one chunk of a lane's prompt; returns the chunk's last-row logits."""
        logits, taps = self.target.prefill(lane.target_slot, chunk, chunk=len(chunk), taps=lane.drafter_slot is not None)
        if taps is not None:
            lane.pending_taps.append(taps)
        return logits

    def first_token(self, lane: Lane, logits: mx.array) -> int:
        position = len(lane.request.prompt)
        token = choose_tokens(
            logits[None], [lane.request.sampling], [lane.request.prompt], [lane_uniform(lane.seed, position, SAMPLE)]
        )
        return int(token.item())

    def run(self, lanes: list[Lane]) -> list[tuple[Lane, LaneEvent]]:
        return self._plain_round(lanes)

    def _plain_round(self, lanes: list[Lane]) -> list[tuple[Lane, LaneEvent]]:
        want_taps = any(lane.drafter_slot is not None for lane in lanes)
        out = self.target.forward([lane.target_slot for lane in lanes], [[lane.anchor] for lane in lanes], taps=want_taps)
        uniforms = [lane_uniform(lane.seed, lane.position + 1, SAMPLE) for lane in lanes]
        tokens = choose_tokens(
            out.logits,
            [lane.request.sampling for lane in lanes],
            [lane.request.prompt + lane.generated for lane in lanes],
            uniforms,
        )
        self.target.commit(out, [1] * len(lanes))
        mx.eval(tokens, *self.target.state_arrays())
        events = []
        for i, (lane, token) in enumerate(zip(lanes, tokens.tolist())):
            if lane.drafter_slot is not None:
                lane.pending_taps.append(out.taps[i : i + 1])
            lane.stats.rounds += 1
            events.append((lane, lane.emit([token])))
        return events

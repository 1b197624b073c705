"""A scripted-acceptance drafter, for measurement only: never a default.

Random-weight checkpoints of real shape have the real costs but no real acceptance. This
wrapper runs the real drafter's forward (so every round pays the drafter's true cost)
and then proposes the continuation a plain run of the same prompt produced, each draft
surviving with the chance a `SurvivalProfile` gives for its position (and, optionally,
the lane's context length); a draft that is meant to fail is replaced by a token the
target will reject. Its confidences are the profile's chances, so pricing sees a
calibrated head. The target still verifies every draft, so output stays exact.

A proposal from anchors only the device knows (an overlapped round, lanes/round.py) is
looked up on the device in a table of every recorded position's scripted block, the
same block the host would script there: the host is never asked for the anchor.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from lanes.bands import Band
from lanes.guard import GuardDecision


class AlwaysDraft:
    """A guard that drafts every round: what a test or a soak wants drafted is drafted,
    whatever the machine's timings say."""

    def decide(self, lanes: int, context_tokens: int) -> GuardDecision:
        return GuardDecision(True, False, Band.of(lanes, context_tokens), None, None, "always (measurement)")

    def record(self, decision, round_seconds, emitted_tokens) -> None:
        pass

    def snapshot(self) -> dict:
        return {}


@dataclass(frozen=True)
class SurvivalProfile:
    """Conditional survival chances s_k (draft k survives given drafts before it did).

    `chances` are per position at short context; `context_points` ((tokens, s), ...),
    when given, replace them with one chance for every position, interpolated in
    log2(context) between the points (flat beyond the ends)."""

    chances: tuple[float, ...] = ()
    context_points: tuple[tuple[int, float], ...] = ()

    def at(self, context: int, width: int) -> list[float]:
        if not self.context_points:
            return [self.chances[min(k, len(self.chances) - 1)] for k in range(width)]
        xs = [math.log2(t) for t, _ in self.context_points]
        ys = [s for _, s in self.context_points]
        x = math.log2(max(context, 1))
        i = bisect.bisect_left(xs, x)
        if i == 0:
            s = ys[0]
        elif i == len(xs):
            s = ys[-1]
        else:
            s = ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return [s] * width

    def mean_accepted(self, context: int, drafts: int) -> float:
        """Expected accepted drafts when all `drafts` are verified: sum_k prod_{j<=k} s_j."""
        total, survive = 0.0, 1.0
        for s in self.at(context, drafts):
            survive *= s
            total += survive
        return total


def published_profile() -> SurvivalProfile:
    """About 4.8 tokens per round at verify width 10 (3.8 accepted of 9 drafts, plus the
    target's own token): the acceptance LiquidAI publishes for its DSpark drafters at 4K,
    with survival falling along the block as trained drafters' does."""
    return SurvivalProfile(tuple(round(0.865 - 0.02 * k, 3) for k in range(9)))


def falling_with_context_profile() -> SurvivalProfile:
    """Acceptance that falls with context: 0.55 accepted/proposed at 4K down to 0.07 at
    128K when 9 drafts are verified (published drafters were trained at about 4K)."""
    return SurvivalProfile(context_points=((4096, 0.88), (131072, 0.39)))


def uniform_draws(keys: Sequence[int], count: int) -> np.ndarray:
    """`count` uniform draws in [0, 1) for each key, a function of the key alone (splitmix64
    over key + i), for every lane at once: the lane core's drafted rounds are timed, and a
    seeded generator per lane per round (tens of microseconds each) would charge them host
    work that no real drafter does."""
    x = np.array(keys, dtype=np.int64).astype(np.uint64)[:, None] + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class ScriptedProposal:
    tokens: mx.array
    confidences: mx.array | None  # None from the device's table (rounds that read none)
    real: object  # the real forward's proposal: evaluated with this one, and validated

    def arrays(self) -> list[mx.array]:
        return [self.tokens, *([self.confidences] if self.confidences is not None else []), *self.real.arrays()]


class ScriptedDrafter:
    """Wraps a drafter; `sequences` are whole plain-run token sequences (prompt +
    continuation), one per prompt the benchmark sends; `record` adds one later."""

    def __init__(self, drafter, sequences: Sequence[Sequence[int]], profile: SurvivalProfile, vocab_size: int, seed: int = 0):
        self.drafter = drafter
        self.profile = profile
        self.vocab_size = vocab_size
        self.seed = seed
        self._sequences: list[list[int]] = []
        self._known: set[tuple[int, ...]] = set()
        self._history: dict[int, list[int]] = {}
        self._match: dict[int, int] = {}  # slot -> index of its recorded sequence
        # The device's table of scripted blocks (see `_device_blocks`): row base[i] + n is
        # sequence i's block after its first n tokens; row 0 scripts nothing.
        self._tables: tuple[mx.array, mx.array] | None = None
        self._table_width = 0
        self._bases: list[int] = []
        for sequence in sequences:
            self.record(sequence)
        # Built before any round is timed (a later width or recording extends it) and
        # evaluated here: MLX streams are thread-local, and a server builds its engine
        # on a loader thread, not the engine thread that runs rounds.
        mx.eval(*self._device_blocks(drafter.width))

    def record(self, sequence: Sequence[int]) -> None:
        """Propose from this plain run too (once however often it is recorded). Call it on
        the thread that runs rounds: `propose` reads the recordings."""
        key = tuple(sequence)
        if key not in self._known:
            self._known.add(key)
            self._sequences.append(list(sequence))

    # The protocol the lane core uses, delegated where the real drafter's work is wanted.
    @property
    def tap_layers(self):
        return self.drafter.tap_layers

    @property
    def width(self) -> int:
        return self.drafter.width

    @property
    def config(self):
        return self.drafter.config

    def state_arrays(self) -> list[mx.array]:
        return self.drafter.state_arrays()

    def kv_bytes(self) -> int:
        return self.drafter.kv_bytes()

    def kv_bytes_in_use(self) -> int:
        return self.drafter.kv_bytes_in_use()

    def open_lane(self):
        slot = self.drafter.open_lane()
        self._history[slot.slot] = []
        return slot

    def close_lane(self, lane) -> None:
        self._history.pop(lane.slot, None)
        self._match.pop(lane.slot, None)
        self.drafter.close_lane(lane)

    def append(self, lanes, taps, tokens, bucket_rows: bool = False) -> None:
        self.drafter.append(lanes, taps, tokens, bucket_rows)
        for lane, ids in zip(lanes, tokens):
            self._history[lane.slot] += ids

    def append_window(self, lanes, taps, width: int, at) -> None:
        self.drafter.append_window(lanes, taps, width, at)

    def landed(self, lanes, tokens) -> None:
        self.drafter.landed(lanes, tokens)
        for lane, ids in zip(lanes, tokens):
            self._history[lane.slot] += ids

    def context_rows(self, lane, start: int, end: int):
        return self.drafter.context_rows(lane, start, end)

    def restore_context(self, lane, tokens, *rows) -> None:
        self.drafter.restore_context(lane, tokens, *rows)
        self._history[lane.slot] = list(tokens)

    def validate(self, proposal: ScriptedProposal) -> list:
        """A lane whose real forward went non-finite fails its round as it would unscripted."""
        return self.drafter.validate(proposal.real)

    def propose(self, lanes, anchors, width=None, pick=None, *, chain_logits=True, confidences=True, at=None) -> ScriptedProposal:
        # The real forward is paid as the lane core asks for it; its drafts are replaced.
        real = self.drafter.propose(lanes, anchors, width, pick, chain_logits=chain_logits, confidences=confidences, at=at)
        g = real.tokens.shape[1]
        if isinstance(anchors, mx.array):
            return self._device_proposal(lanes, at, g, real)
        truths, chances, keys = [], [], []  # the profile's chances stand for the confidences, cheap to give either way
        for lane, anchor in zip(lanes, anchors):
            history = self._history[lane.slot]
            n = len(history) + 1  # tokens up to and including the anchor
            truths.append(self._continuation(lane.slot, history, anchor, g))
            chances.append(self.profile.at(n, g))
            keys.append(hash((self.seed, n, *history[-3:], anchor)))
        truth, chances = np.array(truths, dtype=np.int64), np.array(chances)
        survived = np.cumprod(uniform_draws(keys, g) < chances, axis=1).astype(bool)
        tokens = np.where(survived, truth, (truth + 1) % self.vocab_size)
        return ScriptedProposal(mx.array(tokens, dtype=mx.int32), mx.array(chances, dtype=mx.float32), real)

    def _device_proposal(self, lanes, at, g: int, real) -> ScriptedProposal:
        """The scripted blocks of lanes whose anchors sit at the device's lengths `at`
        (the anchor is token n = length + 1 of the lane's sequence), gathered from the
        device's table: each lane stays on the sequence it matched, on the host's proposals
        or here by its committed tokens (a lane that joined a round in flight has had no
        host proposal), matched again where those leave it."""
        truths, survived = self._device_blocks(g)
        for lane in lanes:
            self._follow(lane.slot)
        known = [lane.slot in self._match for lane in lanes]
        bases = [self._bases[self._match[lane.slot]] if k else 0 for lane, k in zip(lanes, known)]
        ends = [len(self._sequences[self._match[lane.slot]]) if k else 0 for lane, k in zip(lanes, known)]
        rows = mx.array(bases, dtype=mx.int32) + mx.minimum(at.lengths + 1, mx.array(ends, dtype=mx.int32))
        rows = mx.where(mx.array(known), rows, 0)
        truth, kept = truths[rows], survived[rows]
        tokens = mx.where(kept, truth, (truth + 1) % self.vocab_size)
        return ScriptedProposal(tokens, None, real)

    def _device_blocks(self, g: int) -> tuple[mx.array, mx.array]:
        """Every recorded position's scripted block as the host would script it there
        (`_continuation`'s tokens, the draws keyed alike), `[rows, g]` tokens and whether
        each survives; extended as sequences are recorded."""
        if self._tables is None or self._table_width != g:
            self._tables, self._table_width, self._bases = (mx.zeros((1, g), dtype=mx.int32), mx.zeros((1, g), dtype=mx.bool_)), g, []
        truths, survived = self._tables
        rows = truths.shape[0]
        added_truths, added_survived = [], []
        for sequence in self._sequences[len(self._bases) :]:
            self._bases.append(rows)
            n = np.arange(len(sequence) + 1)  # row n: the block after the first n tokens
            padded = np.array(sequence + [0] * g, dtype=np.int64)
            added_truths.append(padded[n[:, None] + np.arange(g)])
            keys = [hash((self.seed, k, *sequence[max(k - 4, 0) : k - 1], sequence[k - 1])) if k else 0 for k in range(len(n))]
            chances = np.array([self.profile.at(k, g) for k in range(len(n))])
            added_survived.append(np.cumprod(uniform_draws(keys, g) < chances, axis=1).astype(bool))
            rows += len(n)
        if added_truths:
            truths = mx.concatenate([truths, mx.array(np.concatenate(added_truths), dtype=mx.int32)])
            survived = mx.concatenate([survived, mx.array(np.concatenate(added_survived))])
            self._tables = (truths, survived)
        return truths, survived

    def _continuation(self, slot: int, history: list[int], anchor: int, g: int) -> list[int]:
        """The recorded tokens after history + anchor (token 0 past the recording)."""
        n = len(history) + 1
        index = self._match.get(slot)
        # Committed tokens are the target's own, so a lane stays on the sequence it
        # matched once; checking the anchor alone keeps long contexts cheap.
        cached = index is not None and len(self._sequences[index]) > n and self._sequences[index][n - 1] == anchor
        if not cached:
            index = next((i for i, seq in enumerate(self._sequences) if self._continues(seq, history, anchor)), None)
            if index is None:
                return [0] * g
            self._match[slot] = index
        found = self._sequences[index][n : n + g]
        return found + [0] * (g - len(found))

    def _follow(self, slot: int) -> None:
        """Keep the slot on a recorded sequence its committed tokens begin (the first such,
        until a later token tells them apart; none: it scripts nothing)."""
        history, index = self._history[slot], self._match.get(slot)
        n = len(history)
        if index is not None and len(self._sequences[index]) > n and self._sequences[index][n - 1 : n] == history[-1:]:
            return
        index = next((i for i, seq in enumerate(self._sequences) if len(seq) > n and seq[:n] == history), None)
        if index is None:
            self._match.pop(slot, None)
        else:
            self._match[slot] = index

    @staticmethod
    def _continues(sequence: list[int], history: list[int], anchor: int) -> bool:
        n = len(history)
        return len(sequence) > n + 1 and sequence[n] == anchor and sequence[:n] == history

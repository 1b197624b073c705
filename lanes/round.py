"""One shared round over every decoding lane, and the prefill that precedes it.

A round: decide whether drafting pays (the guard), give each drafting lane a proposal
(looked up in its own tokens where that is worth more, the rest from one batched drafter
forward), price their verify windows before the target runs, verify every lane's rows in
one target forward, accept per lane, commit (KV trim, conv rebuild, drafter context
append of anchor + accepted rows), emit, and record what the round cost.

A drafted round reads the device once: the drafter's proposal flows into the verify
forward on the device and is read with the target's choices. Pricing then cannot see
this round's confidences, so it prices the drafter's windows by survival counted per
position and context band instead (and the drafter leaves its confidences out), before
the drafter runs: a round whose every window takes no draft runs plain. Where a verify's cost
grows with its rows (`price_live`, by default where shapes are not padded to steady
buckets) the round reads the proposal first and prices from its calibrated confidences,
at the cost of a second sync.

Where the device runs behind the host (a GPU), drafted rounds overlap as plain rounds
do (`overlap`): the next round is built and launched from the anchors and lengths of
the round before as the device holds them (its choices, seeded draws and penalties
too, and its acceptance made on the device), and the round before is read while the
next one runs. Lanes that end leave their rows in it behind, and lanes that join (their
prompts read) start from the host's state beside the others: as lanes come and go, the
rounds go on overlapping. Live prices read each round's drafts on the host first, so
their rounds take one at a time; so does a round where a lane's tokens, as last read,
hold a prompt lookup worth more than the drafter's proposal (found exactly at the
anchor then).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from .bands import Band, context_band
from .calibration import ConfidenceCalibrator
from .counters import RoundCounters
from .guard import DraftGuard, GuardDecision
from .lane import Lane, LaneEvent
from .logprobs import logprob_arrays, read_logprobs
from .lookup import MAX_NGRAM, NgramIndex, check_min_ngram
from .penalty import SeenTokens, mark, penalize, with_drafts_before
from .pricing import CostTable, CountedChances, NoCostData, chain_chances, plan_depths
from .protocols import DeviceLengths
from .sampling import SamplingParams, choose, noise_keys_on_device, row_keys
from .verify import Window, accepted_on_device, row_choices

log = logging.getLogger("laneserve.round")

# A lane keeps at most this many committed rows of taps waiting for the drafter: past it
# they are folded into the drafter's context even while the guard keeps rounds plain, so
# memory stays bounded and a later (probe) round finds the context complete.
PENDING_TAPS_LIMIT = 64
VERIFY_WIDTH_CEILING = 32
# Verify rounds round their attention's key span up to a multiple of this (see the
# target's RaggedLayout): steady shapes from round to round.
KEY_BUCKET = 256
# The drafter's yield (accepted drafts per window) is the mean of its last this many
# windows; lookup is weighed against it once it has at least MIN_DRAFTER_WINDOWS.
DRAFTER_YIELD_WINDOWS = 256
MIN_DRAFTER_WINDOWS = 8


def drafter_pick(lanes: list[Lane], width: int, seen: SeenTokens):
    """The drafter's `pick(logits, k)`: each lane's own choice rule over the chain logits
    of block row k, as the verify will apply it at that row: the noise the target draws
    with at that position, and the lane's repetition penalty over its tokens and the
    drafts before row k. So a proposal tracks the target's own choice where the penalty
    steers it off the text the drafter learnt. None (argmax) when every lane is greedy
    without a penalty."""
    params = [lane.request.sampling for lane in lanes]
    keys = [row_keys(lane.seed, p, lane.position + 1, width) for lane, p in zip(lanes, params)]  # zeros when greedy
    penalized = any(p.repetition_penalty != 1.0 for p in params)
    return chain_pick(params, lambda k: [row[k] for row in keys], seen.rows(lanes) if penalized else None)


def chain_pick(params: list[SamplingParams], keys, seen: mx.array | None):
    """`drafter_pick` from block row k's noise keys, `keys(k)` (host ints, or an array of
    keys at positions only the device knows), and what each lane has seen, `seen [N, V]`
    (None: no lane has a penalty)."""
    if seen is None:
        return None if all(p.greedy for p in params) else lambda logits, k: choose(logits, params, keys(k))
    penalties = [p.repetition_penalty for p in params]
    lane_rows = mx.arange(len(params))

    def pick(logits: mx.array, k: int) -> mx.array:
        nonlocal seen  # what row k sees: the lanes' tokens, then drafts 1..k
        chosen = choose(penalize(logits, seen, penalties), params, keys(k))
        seen = mark(seen, lane_rows, chosen)
        return chosen

    return pick


def lane_ids(lanes: list[Lane]) -> tuple[int, ...]:
    return tuple(id(lane) for lane in lanes)


def packed_taps(pieces: list[tuple[mx.array, int, int]]) -> mx.array:
    """Rows `start..stop-1` of each piece's round taps, one piece after another (lazy):
    one gather where every piece comes from the same round's taps, as after a drafted
    round, where a concatenation would copy each piece by its own kernel."""
    if len(pieces) == 1:
        source, start, stop = pieces[0]
        return source[start:stop]
    if len({id(source) for source, _, _ in pieces}) == 1:
        return pieces[0][0][mx.array([row for _, start, stop in pieces for row in range(start, stop)], dtype=mx.int32)]
    return mx.concatenate([source[start:stop] for source, start, stop in pieces])


@dataclass
class PromptRead:
    """A prompt chunk launched on the device: the lanes whose prompts it ends, with their
    first tokens (and logprobs) lazy, and its last rows' logits, which the host waits on
    to know the chunk has run."""

    lanes: list[Lane]
    marker: mx.array
    tokens: mx.array | None = None
    logprobs: list[mx.array] = field(default_factory=list)
    wanted: list[int | None] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        return [*([self.tokens] if self.tokens is not None else []), *self.logprobs]


@dataclass
class PlainDispatch:
    """A plain round launched on the device whose tokens the host has not read yet."""

    lanes: list[Lane]
    out: object  # the target's RoundOutput
    tokens: mx.array  # lazy [N] choices
    anchors: list[int] | None  # host ids of the rows fed (known once the round before lands)
    started: float
    pipelined: bool
    logprobs: list[mx.array] = field(default_factory=list)  # lazy, for lanes that asked
    decision: GuardDecision | None = None
    context: int = 0
    behind_prompt: bool = False  # launched after a prompt's chunk that no read waits for (see RoundReport)


@dataclass
class DraftedDispatch:
    """A drafted round launched on the device whose outcome the host has not read: the
    next round starts from its `anchors` and `lengths` on the device."""

    lanes: list[Lane]
    out: object  # the target's RoundOutput
    proposal: object  # the drafter's, read for its faults when the round lands
    drafting: list[int]  # the lanes (by index) it proposed for, in its rows' order; the others rode along
    width: int  # rows every lane fed
    depths: list[int]  # drafts priced into each lane's window
    choices: mx.array  # lazy [N * width]: the target's choice on every row
    accepted: mx.array  # lazy [N]: drafts each lane keeps
    anchors: mx.array  # lazy [N]: each lane's next anchor
    lengths: DeviceLengths  # each lane's committed length once the round is kept
    started: float
    draft_seconds: float
    logprobs: list[mx.array]  # lazy, for lanes that asked (`logprob_arrays` over every row)
    wanted: list[int | None]  # per row
    seen: mx.array | None  # lazy [N, V]: each lane's tokens once the round is kept (where a lane has a penalty)
    decision: GuardDecision | None = None
    context: int = 0
    behind_prompt: bool = False  # as for PlainDispatch

    @property
    def tokens(self) -> mx.array:
        return self.choices


@dataclass
class DrafterRecord:
    """What the drafter's rounds at one context band taught: how its confidences
    calibrate (where a round reads them before pricing), and how many drafts it kept a
    window (weighed against lookups)."""

    calibrator: ConfidenceCalibrator
    yields: deque[int] = field(default_factory=lambda: deque(maxlen=DRAFTER_YIELD_WINDOWS))

    def mean_yield(self) -> float | None:
        """Drafts kept per window over the recent ones, once there are MIN_DRAFTER_WINDOWS."""
        return sum(self.yields) / len(self.yields) if len(self.yields) >= MIN_DRAFTER_WINDOWS else None


@dataclass
class Draft:
    """One lane's proposal this round: from the drafter (`ngram` 0) or looked up in its
    own tokens after a match of `ngram` tokens. A drafter's proposal stays on the device
    until the round reads it (`row`: the lane's row in it); `tokens` and `raw` come then."""

    tokens: list[int] | None
    chances: list[float]  # a_k: the chance that drafts 1..k all survive (calibrated, or counted while unread)
    problem: object = None  # the drafter's DraftError for this lane, if its proposal is unusable
    raw: list[float] | None = None  # the drafter's raw confidences, for calibration
    ngram: int = 0
    row: int | None = None  # the lane's row in the drafter's unread proposal


@dataclass
class RoundReport:
    """What one round did, for metrics and logs."""

    kind: str  # "plain", "drafted" or "probe"
    lanes: int
    rows: int
    emitted: int
    seconds: float
    drafting_lanes: int = 0
    looked_up_lanes: int = 0  # lanes that verified drafts looked up in their own tokens, not drafted
    draft_seconds: float = 0.0
    proposed_per_position: list[int] = field(default_factory=list)  # verified drafts at position k
    accepted_per_position: list[int] = field(default_factory=list)
    decision: GuardDecision | None = None
    overlapped: bool = False  # a drafted round built from the device's state of the round before
    first_of_shape: bool = False  # the first round of its kind, lanes and rows: not timed as evidence
    # Launched after a prompt's chunk that no read waits for: its time may hold the chunk's
    # device time, so it is not timed as evidence either.
    behind_prompt: bool = False
    # A drafted round's seconds by phase (DRAFTED_PHASES; "draft" is draft_seconds): where its time goes, in the log.
    phase_seconds: dict[str, float] = field(default_factory=dict)


# A drafted round's phases, in order: the draft built and launched (lookups, the drafter's
# context append and proposal), the windows priced, the verify built (lazy), the one host
# sync (the verify launched, the device finishing the draft and the verify), the outcomes
# read, and the commit (caches kept, tokens emitted, taps queued).
DRAFTED_PHASES = ("draft", "price", "verify", "wait", "read", "commit")


class RoundRunner:
    """Runs prefill and rounds for the engine. `draft_width` fixes the verify rows of a
    drafted round (anchor + W-1 drafts, every round); None prices them per round and lets
    the guard decide whether to draft at all. `prompt_lookup` n > 0 lets a drafting lane
    take a proposal looked up in its own tokens (a match of at least n tokens) where it
    is worth more than the drafter's (lanes/lookup.py); 0 drafts only with the drafter.
    `price_live` prices each round's windows from the drafter's confidences, read before
    the verify (a second host sync); None: where shapes are not kept steady. `overlap`
    lets drafted rounds overlap (see the module's docstring); None: where the device runs
    behind the host."""

    def __init__(self, target, drafter=None, draft_width: int | None = None, guard: DraftGuard | None = None,
                 costs: CostTable | None = None, clock=time.perf_counter, steady_shapes: bool | None = None,
                 prompt_lookup: int = 0, price_live: bool | None = None, overlap: bool | None = None):
        self.target = target
        self.drafter = drafter
        self.draft_width = draft_width
        self.guard = guard or DraftGuard()
        self.costs = costs or CostTable()
        self.clock = clock
        self.counters = RoundCounters()
        self.seen = SeenTokens(target.vocab_size)
        # Pad varying row counts to buckets and key spans of several lanes to KEY_BUCKET:
        # by default where the backend plans per shape (the family knows which).
        self.steady_shapes = target.plans_per_shape() if steady_shapes is None else steady_shapes
        # Padded to steady buckets, a verify costs about the same at any depth: live
        # confidences would buy little for their sync.
        self.price_live = draft_width is None and (not self.steady_shapes if price_live is None else price_live)
        self._inflight: PlainDispatch | DraftedDispatch | None = None
        self._last_landing = 0.0
        self._shapes_run: set[tuple] = set()  # (kind, overlapped, lanes, rows) of every round run, warm-up's too
        check_min_ngram(prompt_lookup)
        self.prompt_lookup = prompt_lookup if drafter is not None else 0
        if drafter is not None:
            if draft_width is not None and not 2 <= draft_width <= min(drafter.config.max_width + 1, VERIFY_WIDTH_CEILING):
                raise ValueError(
                    f"--draft-width must be within 2..{min(drafter.config.max_width + 1, VERIFY_WIDTH_CEILING)} "
                    f"(anchor + up to {drafter.config.max_width} drafts), got {draft_width}"
                )
            self.proposals = draft_width - 1 if draft_width else min(drafter.width, VERIFY_WIDTH_CEILING - 1)
            self.start_learning()
        # Live prices read each round's drafts on the host before its verify.
        overlap = target.runs_behind_host() if overlap is None else overlap
        self.overlap = overlap and drafter is not None and not self.price_live
        self._lookup_due = False  # the lanes' tokens, as the last overlapped round landed, held a lookup worth taking
        self._prompt_in_flight: PromptRead | None = None  # the last chunk launched that the host has not waited for
        self._behind_prompt = False  # a chunk was launched since the last round was (`_launched_behind_prompt`)
        self._prompt_seconds = 0.0  # the host's time reading prompts (building chunks, waiting for them): not rounds' time
        self._priced = None  # this round's lanes, drafting lanes and depths, as `_priced_out` priced them

    def start_learning(self) -> None:
        """Forget what drafted rounds taught: confidence calibration, counted chances, the
        drafter's yield and time (the warm-up's rehearsal learns into a fresh set)."""
        self.drafter_records: dict[int, DrafterRecord] = {}  # by context band (`drafter_record`)
        # By source (0: the drafter, n: a lookup after an n-token match), kept apart for
        # greedy and sampled lanes (a sampled lane keeps fewer drafts) and by the lane's
        # context band (`counts`).
        self.counted_chances: dict[tuple[bool, int], CountedChances] = {}
        self._draft_seconds: float | None = None  # the drafter's last forward

    def verify_width(self, rows: int) -> int:
        """Rows every lane of a drafted round feeds: the widest window's, bucketed where
        shapes are kept steady."""
        return self.target.row_bucket(rows, self.proposals + 1) if self.steady_shapes else rows

    def taps(self, wanted: bool) -> tuple[int, ...]:
        """The target layers to tap: the drafter's, when a lane in the forward drafts."""
        return self.drafter.tap_layers if wanted else ()

    # ---- prefill -----------------------------------------------------------------

    def prefill(self, lanes: list[Lane], chunks: list[list[int]]) -> PromptRead:
        """Launch the next chunk of each lane's prompt, all lanes in one forward, with the
        first token of each lane whose prompt it ends (lazy: `first_tokens` reads them).
        Launched, not awaited, behind the round in flight: the engine launches its next
        round before reading the first tokens, so a lane joining does not leave the
        device idle while the host waits for its prompt and then builds that round. The
        host's time here is no round's (`_now`)."""
        began = self.clock()
        drafting = [lane for lane in lanes if lane.drafter_slot is not None]
        out = self.target.forward([lane.target_slot for lane in lanes], chunks, logits="last", taps=self.taps(bool(drafting)),
                                  steady=self.steady_shapes)
        self.target.commit(out, [len(chunk) for chunk in chunks])
        for lane, chunk, start in zip(lanes, chunks, out.row_starts):
            if lane.drafter_slot is not None:
                lane.pending_taps.append((out.taps, start, start + len(chunk)))
                lane.pending_tokens += chunk
                if self.prompt_lookup:  # indexed as it is read: a long prompt's index costs no round a stall
                    self._ngrams(lane, read=lane.prefilled + len(chunk))
        ending = [i for i, (lane, chunk) in enumerate(zip(lanes, chunks)) if lane.prefilled + len(chunk) == len(lane.request.prompt)]
        read = PromptRead([lanes[i] for i in ending], out.logits)
        if ending:
            last = out.logits[mx.array(ending)] if len(ending) < len(lanes) else out.logits
            read.tokens = self._choose(last, read.lanes)
            read.wanted = [lane.request.logprobs for lane in read.lanes]
            read.logprobs = logprob_arrays(last, read.tokens, read.wanted)
        # At most one chunk ahead of the host: a long prompt read while no lane decodes
        # would otherwise be launched whole, every chunk's graph held at once.
        if self._prompt_in_flight is not None:
            mx.eval(self._prompt_in_flight.marker)
        mx.async_eval(read.marker, *read.arrays(), *([out.taps] if drafting else []), *self.target.state_arrays())
        # A chunk that ends a prompt is waited for as its first tokens are read; one that
        # ends none runs unseen in the interval of the round launched next.
        self._prompt_in_flight, self._behind_prompt = read, not read.lanes
        # A lane still reading its prompt folds as it goes (its taps would pile up); one whose
        # prompt is read folds at its first round, so its first token does not wait for it.
        ended = {id(lane) for lane in read.lanes}
        self.fold_pending([lane for lane in drafting if id(lane) not in ended], limit=PENDING_TAPS_LIMIT)
        self._prompt_seconds += self.clock() - began
        return read

    def first_tokens(self, read: PromptRead) -> list[tuple[int, object]]:
        """The first token (and its logprob entry, None unless asked) of each lane whose
        prompt `read` ended: waits for that chunk, not for a round launched after it."""
        if not read.lanes:
            return []
        if self._prompt_in_flight is read:
            self._prompt_in_flight = None
        began = self.clock()
        ids = read.tokens.tolist()
        self._prompt_seconds += self.clock() - began
        return list(zip(ids, read_logprobs(read.logprobs, ids, read.wanted)))

    # ---- rounds --------------------------------------------------------------------

    def run(self, lanes: list[Lane]) -> list[tuple[Lane, LaneEvent]]:
        context = max(lane.context for lane in lanes)
        eligible = [lane for lane in lanes if lane.drafter_slot is not None and lane.remaining > 1]
        decision, self._priced = None, None
        if eligible and self.draft_width is None:
            decision = self.guard.decide(len(lanes), context)
            if not decision.draft or self._priced_out(lanes, eligible):
                eligible = []
        if not eligible:
            return self._plain(lanes, decision, context)
        if self.overlap and all(self._overlappable(lane) for lane in lanes) and not self._lookup_wanted(lanes):
            return self._overlapped(lanes, decision, context)
        # Drafting needs every lane's tokens on the host: land the round in flight first.
        events = self._land_inflight()
        lanes = [lane for lane in lanes if not lane.finished]
        drafting = [lane for lane in eligible if not lane.finished]
        if drafting:
            drafted, report = self._drafted_round(lanes, drafting, self._now())
            self._account(report, decision, context)
            events += drafted
        return events

    def _priced_out(self, lanes: list[Lane], drafting: list[Lane]) -> bool:
        """Whether a drafted round would verify no draft, known before any proposal is
        made: where windows are priced ahead of the proposal (by counted survival) and no
        lane wants a lookup, every drafter window priced at no draft. Such a round is a
        plain round's tokens at more than its cost (the drafter's forward, a verify of
        one row per lane that cannot overlap the next): it runs as a plain round, and the
        guard, whose choice it was, is fed it as that choice's outcome. The depths are
        kept for the drafted round that follows (`_priced_before`)."""
        if self.price_live:
            return False
        drafts = [Draft(None, self._counted(0, lane, self.proposals)) for lane in drafting]
        depths = self._price(lanes, drafting, drafts, self._draft_seconds or 0.0)
        self._priced = (lane_ids(lanes), lane_ids(drafting), depths)
        return not any(depths) and not self._lookup_wanted(lanes)

    def _priced_before(self, lanes: list[Lane], drafting: list[Lane]) -> list[int] | None:
        """The depths `_priced_out` found this round for these lanes' drafter windows, if
        it priced them (pricing 16 lanes' windows takes a few hundred microseconds of the
        host's time, which bounds a round on a GPU)."""
        priced, self._priced = self._priced, None
        return priced[2] if priced is not None and priced[:2] == (lane_ids(lanes), lane_ids(drafting)) else None

    def idle(self) -> None:
        """No lane decodes any more: drop a round still in flight (its lanes all ended)."""
        self._inflight = None

    def _account(self, report: RoundReport, decision: GuardDecision | None, context: int) -> None:
        report.decision = decision
        report.first_of_shape = self._first_of_shape(report)
        evidence = not (report.first_of_shape or report.behind_prompt)
        if evidence:
            self.costs.observe(report.rows, report.lanes, context, report.seconds - report.draft_seconds)
        if decision is not None:
            if evidence:
                self.guard.record(decision, report.seconds, self._counted_tokens(report, context))
            if decision.probe:
                report.kind = "probe"
        self.counters.record(report)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("round kind=%s lanes=%d rows=%d emitted=%d seconds=%.6f draft_seconds=%.6f drafting_lanes=%d context=%d%s%s%s",
                      report.kind, report.lanes, report.rows, report.emitted, report.seconds, report.draft_seconds,
                      report.drafting_lanes, context,
                      "".join(f" {name}_seconds={t:.6f}" for name, t in report.phase_seconds.items() if name != "draft"),
                      " first_of_shape=1" if report.first_of_shape else "", " behind_prompt=1" if report.behind_prompt else "")

    def _counted_tokens(self, report: RoundReport, context: int) -> float:
        """The report's tokens as the guard counts them, at its band's smallest lane count:
        each weighs what a token costs plain rounds of the report's lanes against what it
        costs plain rounds of that many (lanes/guard.py), from the cost table, which holds
        this round by now. A ratio of two estimates: a table whose costs all drift
        together (a warm-up's seeds giving way to live rounds) weighs tokens the same."""
        floor = Band.of(report.lanes, context).lanes
        if report.lanes == floor:  # one lane, 16 of 16, a band's smallest: counted as emitted, no estimate read
            return report.emitted
        token_seconds = lambda lanes: self.costs.plain_estimate(lanes, context) / lanes
        return report.emitted * token_seconds(report.lanes) / token_seconds(floor)

    def _first_of_shape(self, report: RoundReport) -> bool:
        """Whether `report` is the first round of its kind, lanes and rows. A shape's first
        round traces the compiled segments for it, and on CUDA builds plans and graphs
        too: in the tail of a batch, where lanes end one by one, each new lane count's
        first rounds took three times a round's time or more on an H100 (session 27's
        round log), so the guard, fed them, found drafting slower in every band the tail
        entered and kept it off there. On the CPU, where rows follow the windows, a width's
        first round could cost more than a wider window's rounds; kept in the cost table
        (costs never fall with rows), it priced every deeper window as dearly until that
        width ran again, which it then seldom did. The warm-up runs the common shapes
        first; the rest are met in service."""
        shape = (report.kind, report.overlapped, report.lanes, report.rows)
        if shape in self._shapes_run:
            return False
        self._shapes_run.add(shape)
        return True

    # ---- plain rounds, pipelined -----------------------------------------------------
    #
    # A plain round is dispatched (evaluated asynchronously) before the previous one is
    # read back: its input is the previous round's choices as a lazy array, so building
    # and launching round t+1 overlaps the device running round t. Tokens are emitted
    # one round later; a lane that ends in round t has one wasted row in round t+1,
    # which is dropped with its caches. A lane that joins (its prompt read) feeds its
    # anchor from the host beside the others' lazy choices.

    def _plain(self, lanes: list[Lane], decision: GuardDecision | None, context: int) -> list:
        previous = self._inflight
        if (isinstance(previous, PlainDispatch) and self._carries_over(lanes, previous)
                and all(self._pipelinable(lane) for lane in previous.lanes if not lane.finished)):
            fed, ahead, order = self._carried_tokens(lanes, previous)
            following = self._dispatch(lanes, fed, ahead)
            events, landed = self._land(previous)
            following.anchors = [landed[i] if i < len(landed) else lane.anchor for lane, i in zip(lanes, order)]
        else:
            events = self._land_inflight()
            live = [lane for lane in lanes if not lane.finished]
            following = self._dispatch(live, [lane.anchor for lane in live]) if live else None
        self._hold(following, decision, context)
        return events

    @staticmethod
    def _carried_rows(lanes: list[Lane], previous: PlainDispatch | DraftedDispatch) -> tuple[list[Lane], list[int]]:
        """The lanes that joined since `previous` was built, and each lane's row among
        previous's lanes followed by the joined ones."""
        rows = {id(lane): i for i, lane in enumerate(previous.lanes)}
        joined = [lane for lane in lanes if id(lane) not in rows]
        rows.update((id(lane), len(previous.lanes) + k) for k, lane in enumerate(joined))
        return joined, [rows[id(lane)] for lane in lanes]

    def _carried_tokens(self, lanes: list[Lane], previous: PlainDispatch) -> tuple[mx.array, list[int], list[int]]:
        """What `lanes` feed a round launched before `previous` lands: each lane's choice
        in it (lazy, one token ahead of what the host has read) or, for a lane that joined
        since, its anchor from the host; how far ahead each is; each lane's row
        (`_carried_rows`)."""
        if previous.lanes == lanes:
            return previous.tokens, [1] * len(lanes), list(range(len(lanes)))
        joined, order = self._carried_rows(lanes, previous)
        tokens = previous.tokens
        if joined:
            tokens = mx.concatenate([tokens, mx.array([lane.anchor for lane in joined], dtype=tokens.dtype)])
        return tokens[mx.array(order, dtype=mx.int32)], [int(i < len(previous.lanes)) for i in order], order

    def _hold(self, following: PlainDispatch | DraftedDispatch | None, decision: GuardDecision | None, context: int) -> None:
        """Keep the round just launched in flight, with what decided it, unless every lane
        in it ended as the round before landed."""
        if following is not None and all(lane.finished for lane in following.lanes):
            following = None
        if following is not None:
            following.decision, following.context = decision, context
        self._inflight = following

    def _now(self) -> float:
        """The clock rounds are timed on: `clock` less the host's time reading prompts, so a
        round's interval does not count a chunk read inside it."""
        return self.clock() - self._prompt_seconds

    def _launched_behind_prompt(self) -> bool:
        """Whether a chunk that ends no prompt was launched since the last round was: the
        round launching now shares its interval with the chunk's device time."""
        behind, self._behind_prompt = self._behind_prompt, False
        return behind

    def plain_key_bucket(self, lanes: int) -> int:
        # One lane attends its exact span with the fused one-query kernel; several lanes
        # need a mask and plain matmuls, whose shapes should stay steady (see KEY_BUCKET).
        return KEY_BUCKET if self.steady_shapes and lanes > 1 else 1

    @staticmethod
    def _pipelinable(lane: Lane) -> bool:
        # One row ahead must stay within the lane's limits.
        return lane.remaining > 1

    def _choose(self, logits: mx.array, lanes: list[Lane], ahead: list[int] | None = None,
                previous: mx.array | None = None) -> mx.array:
        """Each lane's next token from its row of `logits` (lazy): the token at position
        `lane.position + 1 + ahead[i]` (ahead 0 by default). `previous`: the tokens the
        round fed, the round before's choices still on the device and not yet in the
        lanes' histories (a pipelined round), which a repetition penalty must count as
        seen."""
        params = [lane.request.sampling for lane in lanes]
        penalties = [p.repetition_penalty for p in params]
        if any(p != 1.0 for p in penalties):
            seen = self.seen.rows(lanes)
            if previous is not None:
                seen = mark(seen, mx.arange(len(lanes)), previous)
            logits = penalize(logits, seen, penalties)
        ahead = ahead or [0] * len(lanes)
        keys = [row_keys(lane.seed, p, lane.position + 1 + a, 1)[0] for lane, p, a in zip(lanes, params, ahead)]
        return choose(logits, params, keys)

    def _dispatch(self, lanes: list[Lane], anchors, ahead: list[int] | None = None) -> PlainDispatch:
        """Build and launch a plain round; `anchors` are host ids, or a lazy array of the
        tokens the lanes feed, lane i's `ahead[i]` tokens ahead of what the host has read
        (1: the round before's choice; 0: a joined lane's anchor)."""
        started = self._now()
        want_taps = any(lane.drafter_slot is not None for lane in lanes)
        lazy = isinstance(anchors, mx.array)
        fed = anchors if lazy else [[a] for a in anchors]
        out = self.target.forward([lane.target_slot for lane in lanes], fed, taps=self.taps(want_taps),
                                  key_bucket=self.plain_key_bucket(len(lanes)))
        tokens = self._choose(out.logits, lanes, ahead=ahead, previous=anchors if lazy else None)
        logprobs = logprob_arrays(out.logits, tokens, [lane.request.logprobs for lane in lanes])
        self.target.commit(out, [1] * len(lanes))
        # Taps are evaluated with the round, not when the drafter folds them in: a lazy
        # slice would keep the round's layer outputs and graph alive for up to 64 rounds.
        mx.async_eval(tokens, *logprobs, *([out.taps] if out.taps is not None else []), *self.target.state_arrays())
        return PlainDispatch(lanes, out, tokens, None if lazy else list(anchors), started, pipelined=lazy, logprobs=logprobs,
                             behind_prompt=self._launched_behind_prompt())

    def _land_inflight(self) -> list:
        if self._inflight is None:
            return []
        if isinstance(self._inflight, DraftedDispatch):
            events = self._land_drafted(self._inflight, 0.0)
        else:
            events, _ = self._land(self._inflight)
        self._inflight, self._priced = None, None  # the lanes moved on: what was priced before is priced afresh
        return events

    def _round_seconds(self, dispatch: PlainDispatch | DraftedDispatch, pipelined: bool) -> float:
        """A landed round's time: overlapping rounds count the interval between landings."""
        now = self._now()
        seconds = now - (max(self._last_landing, dispatch.started) if pipelined else dispatch.started)
        self._last_landing = now
        return seconds

    def _land(self, dispatch: PlainDispatch) -> tuple[list, list[int]]:
        """Read a dispatched round's tokens, emit them, account for the round."""
        tokens = dispatch.tokens.tolist()
        logprobs = read_logprobs(dispatch.logprobs, tokens, [lane.request.logprobs for lane in dispatch.lanes])
        events = []
        for i, (lane, token, logprob) in enumerate(zip(dispatch.lanes, tokens, logprobs)):
            if lane.finished:  # it ended in the round before; this row was a wasted step
                continue
            if lane.drafter_slot is not None:
                lane.pending_taps.append((dispatch.out.taps, i, i + 1))
                lane.pending_tokens.append(dispatch.anchors[i])
            lane.stats.rounds += 1
            events.append((lane, lane.emit([token], None if logprob is None else [logprob])))
        self.fold_pending([lane for lane in dispatch.lanes if lane.drafter_slot is not None], limit=PENDING_TAPS_LIMIT)
        seconds = self._round_seconds(dispatch, dispatch.pipelined)
        emitted = sum(len(event.token_ids) for _, event in events)
        n = len(dispatch.lanes)
        self._account(RoundReport("plain", n, n, emitted, seconds, behind_prompt=dispatch.behind_prompt), dispatch.decision, dispatch.context)
        return events, tokens

    def fold_pending(self, lanes: list[Lane], limit: int = 0, launch: bool = True) -> None:
        """Move lanes' pending taps into the drafter's context (those holding more than
        `limit` rows), in one batched append, launched unless the caller launches it
        with what reads it (`launch`)."""
        due = [lane for lane in lanes if len(lane.pending_tokens) > limit]
        if not due:
            return
        self.drafter.append([lane.drafter_slot for lane in due], packed_taps([piece for lane in due for piece in lane.pending_taps]),
                            [lane.pending_tokens for lane in due], bucket_rows=self.steady_shapes)
        for lane in due:
            lane.pending_taps, lane.pending_tokens = [], []
        # Launched, not awaited: a host sync here would stall the plain-round pipeline.
        if launch:
            mx.async_eval(self.drafter.state_arrays())

    # ---- drafted rounds, overlapped ----------------------------------------------------
    #
    # A drafted round is built from the round before's anchors and lengths as the device
    # holds them: the drafter proposes from those anchors, the verify feeds anchor +
    # drafts at those lengths, each row's choice (argmax, or the seeded draw, its noise
    # keyed by the device's positions, after the lane's repetition penalty over what it
    # has seen, kept on the device too) is made there, acceptance is counted there (drafts
    # kept while each equals the choice on the row before, up to the priced depth), the
    # caches keep what it says, and the drafter's context takes every verify row at once
    # (rows past the kept ones lie beyond the new length, unread and overwritten). The
    # round before is read while this one runs: its tokens (and logprobs) are emitted,
    # its lengths counted on the host. Lanes that do not draft (no drafter slot) ride
    # along with no drafts. A lane that ends in round t has round t+1's rows wasted,
    # dropped with its caches; round t+2 takes the other lanes' rows of t+1 and the host's
    # state of lanes that joined (`_carried_state`).

    def _overlappable(self, lane: Lane) -> bool:
        # Room in the context for the round in flight and the next, each of up to the
        # widest window (the last rounds before the limit take one at a time); tokens past
        # max_tokens are cut when the round lands, as a lane's tokens past its end are.
        return lane.context + 2 * (self.proposals + 1) <= lane.context_limit

    def _lookup_wanted(self, lanes: list[Lane]) -> bool:
        """Whether a lane's tokens, as the host last read them, hold a lookup proposal worth
        more than the drafter's (`_looked_up`): its round then takes one at a time, the
        lookup found at its anchor. With a drafted round in flight, that read is the one
        taken as the round before it landed."""
        if not self.prompt_lookup:
            return False
        if isinstance(self._inflight, DraftedDispatch):
            return self._lookup_due
        return bool(self._looked_up(lanes, lanes))

    def _overlapped(self, lanes: list[Lane], decision: GuardDecision | None, context: int) -> list:
        previous = self._inflight
        if isinstance(previous, DraftedDispatch) and self._carries_over(lanes, previous):
            following = self._dispatch_drafted(lanes, previous)
            events = self._land_drafted(previous, following.draft_seconds)
            # The bounds tighten to what the round before kept, so they grow by what the
            # lanes keep, not by every round's width.
            following.lengths = DeviceLengths(following.lengths.lengths,
                                              tuple(lane.target_slot.length + following.width for lane in lanes))
            live = [lane for lane in lanes if not lane.finished]
            self._lookup_due = bool(self.prompt_lookup and live and self._looked_up(live, live))
        else:
            events = self._land_inflight()
            live = [lane for lane in lanes if not lane.finished]
            # The drafting lanes may all have ended as the round before landed: the others
            # ride along only beside one that drafts, and go on next round.
            following = self._dispatch_drafted(live, None) if any(lane.drafter_slot is not None for lane in live) else None
        self._hold(following, decision, context)
        return events

    @staticmethod
    def _carries_over(lanes: list[Lane], previous: PlainDispatch | DraftedDispatch) -> bool:
        """Whether a round of `lanes` can start from `previous`, in flight, as the device
        holds it: some lane was in it, and every lane of it still decoding is in this one.
        Lanes that ended leave their rows behind; lanes that joined since (their prompts
        read) start from the host's state beside the others (`_carried_state`)."""
        ids = {id(lane) for lane in lanes}
        return any(id(lane) in ids for lane in previous.lanes) and all(lane.finished or id(lane) in ids for lane in previous.lanes)

    def _carried_state(self, lanes: list[Lane], previous: DraftedDispatch) -> tuple[DeviceLengths, mx.array, mx.array | None]:
        """The lengths, anchors (and seen tokens) `lanes` start a round from, `previous` in
        flight: a lane that was in it takes its row as the device holds it, a lane that
        joined since its own from the host. So lanes ending and joining, as they do in
        service, do not stop the rounds overlapping."""
        if previous.lanes == lanes:
            return previous.lengths, previous.anchors, previous.seen
        joined, order = self._carried_rows(lanes, previous)
        lengths, anchors, seen, bounds = previous.lengths.lengths, previous.anchors, previous.seen, list(previous.lengths.bounds)
        if joined:
            held, joined_seen = self._host_state(joined)
            lengths = mx.concatenate([lengths, held.lengths])
            anchors = mx.concatenate([anchors, mx.array([lane.anchor for lane in joined], dtype=anchors.dtype)])
            bounds += held.bounds
            if seen is not None or joined_seen is not None:  # a lane without a penalty reads no row
                unseen = lambda count: mx.zeros((count, self.target.vocab_size), dtype=mx.bool_)
                seen = mx.concatenate([seen if seen is not None else unseen(len(previous.lanes)),
                                       joined_seen if joined_seen is not None else unseen(len(joined))])
        index = mx.array(order, dtype=mx.int32)
        return (DeviceLengths(lengths[index], tuple(bounds[i] for i in order)), anchors[index],
                None if seen is None else seen[index])

    def _dispatch_drafted(self, lanes: list[Lane], previous: DraftedDispatch | None) -> DraftedDispatch:
        """Build and launch a drafted round from the anchors, lengths (and seen tokens) of
        the round in flight, `previous`, as the device holds them (the host's for lanes
        that joined since), or (None) the host's. Lanes without a drafter ride along with
        no drafts: their anchor and padding."""
        started = self._now()
        g, n = self.proposals, len(lanes)
        params = [lane.request.sampling for lane in lanes]
        if previous is None:
            lengths, seen = self._host_state(lanes)
            anchors = mx.array([lane.anchor for lane in lanes], dtype=mx.int32)
        else:
            lengths, anchors, seen = self._carried_state(lanes, previous)
        keys = None
        if not all(p.greedy for p in params):  # row k of a block or a verify decides position length + 1 + k
            keys = noise_keys_on_device([lane.seed for lane in lanes], lengths.lengths[:, None] + 1 + mx.arange(g + 1))
        drafting = [i for i, lane in enumerate(lanes) if lane.drafter_slot is not None]
        of_drafting = (lambda a: a) if len(drafting) == n else (lambda a: a[mx.array(drafting, dtype=mx.int32)])
        at = DeviceLengths(of_drafting(lengths.lengths), tuple(lengths.bounds[i] for i in drafting))
        pick = chain_pick([params[i] for i in drafting], lambda k: [0] * len(drafting) if keys is None else of_drafting(keys[:, k]),
                          None if seen is None else of_drafting(seen))
        proposed_after = [lanes[i].anchor for i in drafting] if previous is None else of_drafting(anchors)  # the host's this once
        proposal = self.drafter.propose([lanes[i].drafter_slot for i in drafting], proposed_after, g, pick, chain_logits=False,
                                        confidences=False, at=at)
        draft_seconds = self._draft_seconds = self._now() - started
        drafting_lanes = [lanes[i] for i in drafting]
        priced = self._priced_before(lanes, drafting_lanes)
        if priced is None:
            priced = self._price(lanes, drafting_lanes, [Draft(None, self._counted(0, lane, g)) for lane in drafting_lanes],
                                 draft_seconds)
        depths = [0] * n
        for i, depth in zip(drafting, priced):
            depths[i] = depth
        width = self.verify_width(1 + max(depths))
        fed = self._fed_on_device(anchors, proposal.tokens, drafting, width)
        out = self.target.forward([lane.target_slot for lane in lanes], fed.reshape(-1), widths=[width] * n,
                                  taps=self.drafter.tap_layers, key_bucket=KEY_BUCKET, at=lengths)
        rows = [p for p in params for _ in range(width)]
        choices = choose(self._penalized_rows(out.logits, fed, seen, rows), rows,
                         [0] * len(rows) if keys is None else keys[:, :width].reshape(-1))
        wanted = [lane.request.logprobs for lane in lanes for _ in range(width)]
        logprobs = logprob_arrays(out.logits, choices, wanted)
        grid = choices.reshape(n, width)
        accepted = accepted_on_device(fed, grid, depths)
        self.target.keep(out, accepted + 1)
        taps = out.taps if len(drafting) == n else of_drafting(out.taps.reshape(n, width, -1)).reshape(len(drafting) * width, -1)
        self.drafter.append_window([lanes[i].drafter_slot for i in drafting], taps, width, at)
        after = DeviceLengths(lengths.lengths + accepted + 1, tuple(b + width for b in lengths.bounds))
        following = mx.take_along_axis(grid, accepted[:, None], axis=1)[:, 0]
        if seen is not None:  # the tokens each lane keeps, the next anchor last
            kept = (mx.arange(width)[None, :] <= accepted[:, None]).reshape(-1)
            seen = seen.at[mx.repeat(mx.arange(n), width), grid.reshape(-1)].maximum(kept)
        mx.async_eval(choices, accepted, following, after.lengths, *logprobs, *([seen] if seen is not None else []),
                      *proposal.arrays(), *self.target.state_arrays(), *self.drafter.state_arrays())
        return DraftedDispatch(lanes, out, proposal, drafting, width, depths, choices, accepted, following, after, started,
                               draft_seconds, logprobs, wanted, seen, behind_prompt=self._launched_behind_prompt())

    def _fed_on_device(self, anchors: mx.array, drafts: mx.array, drafting: list[int], width: int) -> mx.array:
        """The verify's rows `[N, width]`: each lane's anchor, then its drafts (the
        proposal's row of a drafting lane, clipped into the vocabulary; the drafter's
        later drafts past its depth), or for a lane without a drafter its anchor again."""
        n = anchors.shape[0]
        drafted = mx.clip(drafts[:, : width - 1], 0, self.target.vocab_size - 1).astype(mx.int32)
        if len(drafting) < n:
            row = {i: r for r, i in enumerate(drafting)}
            drafted = mx.where(mx.array([i in row for i in range(n)])[:, None],
                               drafted[mx.array([row.get(i, 0) for i in range(n)], dtype=mx.int32)], anchors[:, None])
        return mx.concatenate([anchors[:, None], drafted], axis=1)

    def _host_state(self, lanes: list[Lane]) -> tuple[DeviceLengths, mx.array | None]:
        """Where a first overlapped round starts: the drafting lanes' contexts brought up to
        their committed tokens, the lanes' lengths, and what they have seen (None: no
        penalty)."""
        drafting = [lane for lane in lanes if lane.drafter_slot is not None]
        self.fold_pending(drafting, launch=False)
        held = [lane.target_slot.length for lane in lanes]
        if [lane.target_slot.length for lane in drafting] != [lane.drafter_slot.length for lane in drafting]:
            raise RuntimeError(f"drafter contexts of {[lane.drafter_slot.length for lane in drafting]} rows for "
                               f"{[lane.target_slot.length for lane in drafting]} committed tokens: the lane core let them drift apart")
        penalized = any(lane.request.sampling.repetition_penalty != 1.0 for lane in lanes)
        return DeviceLengths(mx.array(held, dtype=mx.int32), tuple(held)), self.seen.rows(lanes) if penalized else None

    @staticmethod
    def _penalized_rows(logits: mx.array, fed: mx.array, seen: mx.array | None, rows: list[SamplingParams]) -> mx.array:
        """A verify's logits `[N * W, V]` under each row's repetition penalty (as they are
        without one): row k of a lane has seen the lane's tokens (`seen [N, V]`) and its
        drafts 1..k (`fed [N, W]`)."""
        if seen is None:
            return logits
        n, width = fed.shape
        by_row = with_drafts_before(mx.repeat(seen, width, axis=0), fed.reshape(-1), [(i * width, width) for i in range(n)])
        return penalize(logits, by_row, [p.repetition_penalty for p in rows])

    def _land_drafted(self, dispatch: DraftedDispatch, draft_seconds: float) -> list:
        """Read an overlapped drafted round: emit each lane's tokens, count its kept rows
        on the host, learn from the outcome, account for the round. Its time is the
        interval since the last landing, which holds the next round's draft (its
        `draft_seconds`, 0 where none was built), not its own."""
        chosen, accepted, width = dispatch.choices.tolist(), dispatch.accepted.tolist(), dispatch.width
        per_row = read_logprobs(dispatch.logprobs, chosen, dispatch.wanted)
        problems = dict(zip(dispatch.drafting, self.drafter.validate(dispatch.proposal)))
        events, counts, committed = [], [], []
        proposed_at, accepted_at = [0] * self.proposals, [0] * self.proposals
        for i, (lane, depth, kept) in enumerate(zip(dispatch.lanes, dispatch.depths, accepted)):
            if lane.finished:  # it ended in the round before: these rows were wasted
                counts.append(0)
                continue
            tokens = chosen[i * width : i * width + kept + 1]  # the kept drafts equal the choices before them
            counts.append(kept + 1)
            if lane.drafter_slot is not None:
                committed.append((lane.drafter_slot, [lane.anchor, *tokens[:kept]]))
            if problems.get(i) is not None:  # what it kept equals the target's own choices all the same
                lane.stats.errors.append(str(problems[i]))
                log.warning("lane %s: %s", lane.id, problems[i])
            self._learn(lane, 0, depth, kept, proposed_at, accepted_at)
            logprobs = per_row[i * width : i * width + kept + 1] if lane.request.logprobs is not None else None
            events.append((lane, lane.emit(tokens, logprobs)))
        self.target.count(dispatch.out, counts)
        self.drafter.landed([slot for slot, _ in committed], [ids for _, ids in committed])
        seconds = self._round_seconds(dispatch, pipelined=True)
        emitted = sum(len(event.token_ids) for _, event in events)
        n = len(dispatch.lanes)
        report = RoundReport("drafted", n, n * width, emitted, seconds, len(dispatch.drafting), 0, draft_seconds if draft_seconds < seconds else 0.0,
                             proposed_at, accepted_at, overlapped=True, behind_prompt=dispatch.behind_prompt)
        self._account(report, dispatch.decision, dispatch.context)
        return events

    def _drafted_round(self, lanes: list[Lane], drafting: list[Lane], started: float) -> tuple[list, RoundReport]:
        """Draft, price, verify, commit: the phases of a drafted round, in order, each timed."""
        behind_prompt, ends = self._launched_behind_prompt(), []
        drafts, proposal = self._draft(lanes, drafting)
        ends.append(self._now())
        draft_seconds = ends[-1] - started
        depths = None if any(d.ngram for d in drafts) else self._priced_before(lanes, drafting)
        if depths is None:
            depths = self._price(lanes, drafting, drafts, draft_seconds)
        windows = self._windows(lanes, drafting, drafts, depths)
        ends.append(self._now())
        out, choices = self._verify(lanes, windows, drafting, drafts, proposal)
        ends.append(self._now())
        mx.eval(*choices.arrays(), *(proposal.arrays() if proposal is not None else ()))  # the round's one host sync
        ends.append(self._now())
        outcomes = self._outcomes(choices, proposal, lanes, windows, drafting, drafts)
        ends.append(self._now())
        events, proposed_at, accepted_at = self._commit(lanes, drafting, windows, drafts, out, outcomes)
        ends.append(self._now())
        emitted = sum(len(event.token_ids) for _, event in events)
        report = RoundReport("drafted", len(lanes), sum(out.widths), emitted, ends[-1] - started, len(drafting),
                             sum(1 for d, depth in zip(drafts, depths) if d.ngram and depth), draft_seconds, proposed_at, accepted_at,
                             phase_seconds=dict(zip(DRAFTED_PHASES, (b - a for a, b in zip([started, *ends], ends)))),
                             behind_prompt=behind_prompt)
        return events, report

    def _draft(self, lanes: list[Lane], drafting: list[Lane]) -> tuple[list[Draft], object]:
        """Each drafting lane's proposal: looked up where that is worth more (see
        `_looked_up`), the rest from one batched drafter forward, their contexts first
        brought up to date. The forward is launched, not awaited: its drafts come back
        unread, priced by counted chances, with the proposal they are in (None where
        nothing is unread). With `price_live` it is read here instead."""
        g = self.proposals
        looked = self._looked_up(lanes, drafting)
        asked = [lane for lane in drafting if id(lane) not in looked]
        if not asked:
            return [looked[id(lane)] for lane in drafting], None
        began = self._now()
        self.fold_pending(asked, launch=False)  # launched with the proposal that reads it
        # Verification compares tokens only: the chain's float32 logits are never read, and
        # the confidences only where they price this round.
        proposal = self.drafter.propose([lane.drafter_slot for lane in asked], [lane.anchor for lane in asked], g,
                                        drafter_pick(asked, g, self.seen), chain_logits=False, confidences=self.price_live)
        (mx.eval if self.price_live else mx.async_eval)([*proposal.arrays(), *self.drafter.state_arrays()])
        self._draft_seconds = self._now() - began  # unread: the host's part only
        row = {id(lane): i for i, lane in enumerate(asked)}
        drafts = [looked.get(id(lane)) or Draft(None, self._counted(0, lane, g), row=row[id(lane)]) for lane in drafting]
        if self.price_live:
            self._read(proposal, drafting, drafts)
            return drafts, None
        return drafts, proposal

    def counts(self, greedy: bool, context_tokens: int) -> CountedChances:
        """The survival counted for greedy (or sampled) lanes at `context_tokens` tokens
        of context: one count per context band, as the cost table and the guard keep
        theirs. Drafts survive less far into contexts longer than a drafter trained on
        (the long-context profile of bench_engine: 0.88 per draft at 4K, 0.4 at 126K),
        and counted together a long lane's windows were priced by its short ones' survival,
        verifying every draft where one or two pay."""
        key = (greedy, context_band(context_tokens))
        if key not in self.counted_chances:
            self.counted_chances[key] = CountedChances(MAX_NGRAM + 1, self.proposals)
        return self.counted_chances[key]

    def drafter_record(self, context_tokens: int) -> DrafterRecord:
        """What the drafter's rounds taught at `context_tokens` tokens of context, one
        record per context band as `counts` keeps survival: its confidences run further
        from its survival, and it keeps fewer drafts, the longer the context."""
        band = context_band(context_tokens)
        if band not in self.drafter_records:
            self.drafter_records[band] = DrafterRecord(ConfidenceCalibrator(self.proposals))
        return self.drafter_records[band]

    def _counted(self, source: int, lane: Lane, depth: int) -> list[float]:
        """Chain chances of `depth` drafts from `source` (0: the drafter, n: a lookup
        after an n-token match), as counted for lanes of this lane's kind and context."""
        return chain_chances(self.counts(lane.request.sampling.greedy, lane.context).confidences(source, depth))

    def _read(self, proposal, drafting: list[Lane], drafts: list[Draft]) -> dict[int, list[int]]:
        """Fill the unread drafts from the drafter's evaluated proposal: tokens, raw
        confidences (and, read before pricing, calibrated chances), and the problem of a
        lane whose proposal is unusable (none of its drafts is kept). Returns the usable
        drafts it read, by lane id."""
        problems = self.drafter.validate(proposal)
        tokens = proposal.tokens.tolist()
        confidences = proposal.confidences.tolist() if proposal.confidences is not None else [[1.0] * self.proposals] * len(tokens)
        read = {}
        for lane, draft in zip(drafting, drafts):
            if draft.row is None:
                continue
            draft.tokens, draft.raw, draft.problem, draft.row = tokens[draft.row], confidences[draft.row], problems[draft.row], None
            if self.price_live:  # read before pricing: priced from its calibrated confidences
                draft.chances = chain_chances(self.drafter_record(lane.context).calibrator.calibrate(draft.raw))
            if draft.problem is not None:
                lane.stats.errors.append(str(draft.problem))
                log.warning("lane %s: %s; none of its drafts is kept", lane.id, draft.problem)
            else:
                read[id(lane)] = draft.tokens
        return read

    def _looked_up(self, lanes: list[Lane], drafting: list[Lane]) -> dict[int, Draft]:
        """The drafting lanes (by id) whose looked-up proposal is worth more than the
        drafter's: expected tokens per second of a lane's window, `(1 + E) / T`, with E
        the sum of its chain chances and T the verify round's time, plus the drafter's
        forward for the drafter, which only a round where every lane looks up saves.
        The drafter's E is its recent mean yield at the lane's context band; until it has
        one there, a lookup is taken where it expects to keep a draft (E >= 1): it costs
        nothing to propose, and the drafter gets the lanes without a match."""
        if not self.prompt_lookup:
            return {}
        candidates = {}
        for lane in drafting:
            tokens, n = self._ngrams(lane).propose(self.proposals, self.prompt_lookup)
            tokens = tokens[: max(lane.remaining - 1, 0)]
            if tokens:
                candidates[id(lane)] = (lane, Draft(tokens, self._counted(n, lane, len(tokens)), ngram=n))

        def better(lane: Lane, draft: Draft, drafter_share: float) -> bool:
            drafter_yield = self.drafter_record(lane.context).mean_yield()
            if drafter_yield is None:
                return sum(draft.chances) >= 1
            return 1 + sum(draft.chances) >= (1 + drafter_yield) * drafter_share

        try:
            verify_seconds = self.costs.estimate(len(lanes) * (1 + self.proposals), len(lanes), max(lane.context for lane in lanes))
            saving = verify_seconds / (verify_seconds + (self._draft_seconds or 0.0))
        except NoCostData:  # no timings (a fixed width without warm-up): weigh the yields alone
            saving = 1.0
        if len(candidates) == len(drafting) and all(better(lane, d, saving) for lane, d in candidates.values()):
            return {key: d for key, (_, d) in candidates.items()}  # no lane drafts: the drafter's forward is saved
        return {key: d for key, (lane, d) in candidates.items() if better(lane, d, 1.0)}  # it runs anyway

    @staticmethod
    def _ngrams(lane: Lane, read: int | None = None) -> NgramIndex:
        """The lane's n-gram index, extended with its tokens committed since (anchor last),
        or with its first `read` prompt tokens while the prompt is being read."""
        if lane.ngrams is None:
            lane.ngrams = NgramIndex()
        index, prompt = lane.ngrams, lane.request.prompt
        known = len(index.tokens)
        if known < len(prompt):
            index.extend(prompt[known : len(prompt) if read is None else read])
        if read is None:
            index.extend(lane.generated[max(known - len(prompt), 0) :])
        return index

    def _price(self, lanes: list[Lane], drafting: list[Lane], drafts: list[Draft], draft_seconds: float) -> list[int]:
        """Every drafting lane's verify depth, decided before the target runs: all it may
        take at a fixed width, else the DSpark prefix scheduler over the drafts' chain
        chances (calibrated confidences, or counted survival where a proposal is unread)."""
        caps = [0 if d.problem else min(self.proposals, len(d.chances), lane.remaining - 1) for lane, d in zip(drafting, drafts)]
        if self.draft_width is not None:
            return caps
        # Where shapes are kept steady every lane feeds the widest window's rows, padded to
        # a bucket (see _verify), and the cost table holds rounds by those rows: priced so.
        context = max(lane.context for lane in lanes)
        try:
            return plan_depths(
                [d.chances for d in drafts],
                plain_rows=len(lanes) - len(drafting),
                round_seconds=self.costs.curve(len(lanes), context),
                draft_seconds=draft_seconds,
                max_depths=caps,
                padded_width=self.verify_width if self.steady_shapes else None,
            )
        except NoCostData:  # nothing measured yet (no warm-up): verify every proposal once
            return caps

    @staticmethod
    def _windows(lanes: list[Lane], drafting: list[Lane], drafts: list[Draft], depths: list[int]) -> list[Window]:
        """Each lane's verify window: its anchor and the drafts priced in (none for lanes
        that do not draft this round; an unread proposal's drafts come with the verify)."""
        draft_of = {id(lane): (d, depth) for lane, d, depth in zip(drafting, drafts, depths)}
        windows = []
        for lane in lanes:
            draft, depth = draft_of.get(id(lane), (None, 0))
            known = draft.tokens[:depth] if draft is not None and draft.tokens is not None else []
            windows.append(Window(lane.request.sampling, lane.seed, lane.position, depth, lane.request.logprobs, known))
        return windows

    def _verify(self, lanes: list[Lane], windows: list[Window], drafting: list[Lane], drafts: list[Draft], proposal):
        """One target forward over every lane's rows and each row's choice (lazy), to be
        evaluated in one host sync with the drafter's `proposal` where it is still unread.

        Every lane feeds the same number of rows, padded past its window: rows after a
        lane's window are never kept, never seen by its real rows (they sit at later
        positions), and one width per round keeps shapes steady. A lane near the context
        limit pads only up to it (its window already fits)."""
        width = self.verify_width(max(w.rows for w in windows))
        limit = self.target.context_limit
        widths = [min(width, limit - lane.position) for lane in lanes]
        fed = self._fed_rows(lanes, windows, widths, drafting, drafts, proposal)
        out = self.target.forward([lane.target_slot for lane in lanes], fed, widths=widths,
                                  taps=self.drafter.tap_layers, key_bucket=KEY_BUCKET)
        return out, row_choices(out.logits, out.row_starts, windows, self._seen_rows(lanes, windows, out, fed))

    def _outcomes(self, choices, proposal, lanes: list[Lane], windows: list[Window], drafting: list[Lane],
                  drafts: list[Draft]) -> list:
        """Once the verify is evaluated: the drafts the proposal held (into their windows)
        and each lane's outcome."""
        if proposal is not None:
            read = self._read(proposal, drafting, drafts)
            for lane, w in zip(lanes, windows):
                if id(lane) in read:
                    w.drafts = read[id(lane)][: w.depth]
        return choices.accept()

    def _fed_rows(self, lanes: list[Lane], windows: list[Window], widths: list[int], drafting: list[Lane],
                  drafts: list[Draft], proposal) -> mx.array:
        """The verify's rows, packed lane after lane `[sum(widths)]` (lazy): each lane's
        anchor, then its drafts, then padding (its last token, or the drafter's later
        drafts). Drafts the host has not read are taken from the proposal on the device,
        clipped into the vocabulary (a faulty proposal's ids are never kept)."""
        row_of = {id(lane): d.row for lane, d in zip(drafting, drafts) if d.row is not None}
        g = self.proposals
        # Rows are gathered from one table: the drafter's drafts [lanes asked * g], then the host's.
        drafted = mx.clip(proposal.tokens, 0, self.target.vocab_size - 1).astype(mx.int32).reshape(-1) if row_of else None
        offset = 0 if drafted is None else drafted.shape[0]
        host, index = [], []
        for lane, w, rows in zip(lanes, windows, widths):
            if id(lane) in row_of:  # row k > 0 is the drafter's draft k (its last, past g)
                index += [offset + len(host)] + [row_of[id(lane)] * g + min(k, g) - 1 for k in range(1, rows)]
                host.append(lane.anchor)
            else:
                known = [lane.anchor] + w.drafts
                index += range(offset + len(host), offset + len(host) + rows)
                host += known + known[-1:] * (rows - len(known))
        host_rows = mx.array(host, dtype=mx.int32)
        if drafted is None:
            return host_rows
        return mx.concatenate([drafted, host_rows])[mx.array(index, dtype=mx.int32)]

    def _seen_rows(self, lanes: list[Lane], windows: list[Window], out, fed: mx.array) -> mx.array | None:
        """What each verify row has seen, for repetition penalties (None without one): the
        lane's tokens, and the drafts before the row (taken from the fed rows)."""
        if all(w.params.repetition_penalty == 1.0 for w in windows):
            return None
        return with_drafts_before(self.seen.rows(lanes, out.widths), fed, [(start, w.rows) for start, w in zip(out.row_starts, windows)])

    def _learn(self, lane: Lane, source: int, depth: int, accepted: int, proposed_at: list[int], accepted_at: list[int]) -> None:
        """What a lane's round teaches, `depth` drafts from `source` (0: the drafter, n: a
        lookup after an n-token match) verified and `accepted` kept: its stats, the counted
        chances of its kind of lane at its context, the drafter's yield, the round's drafts by position."""
        lane.stats.rounds += 1
        if not depth:
            return
        lane.stats.drafted_rounds += 1
        lane.stats.proposed += depth
        lane.stats.accepted += accepted
        lane.stats.accepted_per_round.append(accepted)
        self.counts(lane.request.sampling.greedy, lane.context).observe(source, depth, accepted)
        if source:
            lane.stats.looked_up_rounds += 1
        else:
            self.drafter_record(lane.context).yields.append(accepted)
        for k in range(depth):
            proposed_at[k] += 1
            accepted_at[k] += k < accepted

    def _commit(self, lanes: list[Lane], drafting: list[Lane], windows: list[Window], drafts: list[Draft],
                out, outcomes) -> tuple[list, list[int], list[int]]:
        """Keep each lane's accepted rows (KV trimmed, conv state rebuilt, taps queued for
        the drafter), emit its tokens, and learn from the outcome (calibration, lookup
        chances, the drafter's yield, stats)."""
        self.target.commit(out, [1 + o.accepted for o in outcomes])
        mx.async_eval(self.target.state_arrays())  # the next round builds while this lands
        draft_of = {id(lane): d for lane, d in zip(drafting, drafts)}
        events = []
        proposed_at, accepted_at = [0] * self.proposals, [0] * self.proposals
        for lane, window, outcome, start in zip(lanes, windows, outcomes, out.row_starts):
            if lane.drafter_slot is not None:
                lane.pending_taps.append((out.taps, start, start + 1 + outcome.accepted))
                lane.pending_tokens += [lane.anchor] + window.drafts[: outcome.accepted]
            depth = len(window.drafts)
            draft = draft_of[id(lane)] if depth else None
            # Calibrated confidences price only rounds that read the proposal first.
            if draft is not None and not draft.ngram and self.price_live:
                self.drafter_record(lane.context).calibrator.observe(draft.raw[:depth], depth, outcome.accepted)
            self._learn(lane, draft.ngram if draft else 0, depth, outcome.accepted, proposed_at, accepted_at)
            events.append((lane, lane.emit(outcome.tokens, outcome.logprobs)))
        self.fold_pending([lane for lane in lanes if lane.drafter_slot is not None], limit=PENDING_TAPS_LIMIT)
        return events, proposed_at, accepted_at

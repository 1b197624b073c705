"""The draft guard: does drafting pay this round?

Drafting costs a drafter forward and wider verifies; whether it pays depends on how
many lanes share the round and how long their contexts are, so the guard keeps its
evidence per (lanes band, context band) and compares what rounds actually delivered:
tokens emitted per second of round time, each round's tokens counted at its band's
smallest lane count (the caller's count; the round runner's is below).

Why counted: a band holds rounds of several lane counts (8-15 lanes, say), and tokens per
second moves with the lane count more than with the choice. On a GPU a round takes
about as long at any lane count, so plain rounds of 15 lanes emit nearly twice the
tokens a second of plain rounds of 8: drafting explored at 8 lanes lost to plain explored
at 15 although it paid at each, and in a batch's tail, crossed downward, drafting's
recent evidence from few lanes lost to plain's older evidence from more (session 33
logged 15 such verdicts where, lane count by lane count, drafting won). So the runner
counts a round's tokens as the tokens plain rounds of the band's smallest lane count
emit in the time plain rounds of the round's own lanes take for them: tokens x (p(L) / L)
/ (p(F) / F), with p a plain round's cost from its cost table, L the round's lanes and F
the band's smallest. Plain rounds of any lane count then run at the rate of plain rounds
of F lanes, and drafted rounds at their speedup over plain at their own lane count times
that rate; at F lanes, and in bands of one lane count, tokens count as they are. A ratio
of two estimates, the count does not move as the cost table's estimates all drift
together (a warm-up's seeds, timed without a round's host work, giving way to live
rounds); counted in plain seconds alone, evidence recorded before such a drift would
weigh against evidence recorded after it.

Per band:
- Exploration: a band with no evidence drafts for its first `explore_rounds` counted
  rounds, then runs plain for as many, so both choices have a measurement.
- Warm rounds: the first `warm_rounds` rounds of each choice in a band are run but not
  counted. A new band is new shapes (more lanes, longer key spans), and a backend's
  first round at new shapes can pay for building kernels or plans many times over what
  the round costs after; counted, it would decide the band on its own. (Within a band,
  the round runner keeps from the guard the first round of every lane count and row
  count it meets, for the same reason: it traces, and on CUDA plans, for its shape.)
- After that it runs the choice whose realised throughput is higher (drafting only while
  drafted rounds measure strictly faster) and now and then probes the other choice, so
  that a change (acceptance rising or falling) is noticed and the guard switches back.
- What to probe: drafting's throughput moves with the text a lane writes (what the
  drafter guesses right), plain's does not (one token a lane, in a round whose time its
  band fixes). So the budget below pays for probing drafting only; plain, when it loses,
  is probed only once its evidence is stale: decayed below `STALE_WEIGHT` rounds (one
  round about 60 rounds ago at the default memory). A plain probe where drafting
  wins loses a good part of a round (on the H200 the default's plain round is 2.6 ms, of
  which about 1 ms is lost against drafting), and paid from the budget as drafted probes
  are, plain probes took most of it: drafting's estimate, once a hard stretch of text had
  sunk it, then went unprobed for hundreds of rounds while drafting would have paid.
  Drafting is probed from the budget alone, however stale its evidence: where it loses
  by far (long contexts: probes of the 2.6B shape at 32K tokens took 17-50 ms on the
  H200 against 6 ms plain rounds), a probe every 60 rounds would lose about 5% of the
  band's time on its own.
- Probe budget (the precise rule): what a probe costs is the time it loses against the
  winner, `seconds - tokens / winner_tps` (at least 0). A drafted probe runs only if,
  counting it at its choice's mean round and throughput, the band's probe charges stay <=
  `budget` x all seconds recorded in the band (probes included). A probe's charge is
  what it lost (`probe_charge`), scaled up for a drafted probe where drafting measured
  below FAR_LOSER (half) of plain's throughput when it ran: at a quarter, its probes
  lose at most half the budget. A far loser's probe is unlikely to find it winning,
  and spent whole the budget cost 2.0% and 3.3% of the time of the 2.6B shape's
  drafting-capable engine at 32K and 126K tokens on an H100 (session 28), where a
  drafted probe keeps a small fraction of plain's throughput (above: 17-50 ms rounds
  against 6 ms). (Scaling the budget instead would shrink what the band's past seconds
  allow whenever drafting's estimate dips, and pause its probes for as long as the band
  is old.) The default budget is 2%: at long contexts, where drafting loses, the
  drafting-capable engine should run within 3% of a plain one, and its taps and context
  folds take some of that. A drafted round that measures nearly as fast as plain costs
  little to probe and is probed often, so a close call is re-measured soon, while a
  clear loser is probed rarely. Exploration rounds are not probes and are not counted
  in the budget; they happen once per band.
- Probe share: probes run on at most `max_probe_share` of a band's recent rounds (an
  average over rounds decayed like the evidence). Without it a winner whose estimate has
  sunk to just above the loser's makes probes of the loser nearly free, so the loser
  runs round after round and the winner never runs to correct its estimate. Drafting,
  whose rounds keep anything from no draft to all of them, fell into this when plain
  probes were paid from the budget, and ran plain most of the time where it paid 1.6x;
  plain is now probed only when stale, and the share still bounds drafted probes.
- Throughput per choice is a ratio of decayed sums (tokens over seconds). Both choices'
  sums decay by `1 - smoothing` on every round recorded in the band, so the winner is
  judged on roughly its last 1/smoothing rounds and the loser on its latest probe or two.
  So one lucky probe can flip the choice; the new winner's own rounds then flip it back
  within a few rounds if the probe was luck. The default memory is about 20 rounds: a
  drafted round keeps anything from no draft to all of them, and with 10 a run of poor
  ones sent the guard plain through stretches where drafting paid (replayed on the
  default's real acceptance, `bench.guard_replay`).
- Outliers: a round counts at most `outlier_factor` times the mean round time its
  choice has shown in the band, so one slow round (a kernel compiled or a plan built on
  the first use of a shape) cannot decide a band on its own. Probe accounting uses the
  real seconds.
- Bands keep their evidence, so a lane that arrives in a band where drafting lost starts
  plain.

Time comes from the round seconds passed to `record`: no clock is read here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from lanes.bands import Band

logger = logging.getLogger("laneserve.guard")

# Plain, losing, is probed once its decayed evidence weighs less than this many rounds:
# one round recorded 59 rounds ago at the default smoothing (0.05), more rounds further back.
STALE_WEIGHT = 0.05

# Drafting measured below this share of plain's throughput is a far loser: text would
# have to more than double what its rounds keep for it to win, so its probes are charged
# more than they lose (probe_charge). Above it the charge is the loss: in a close call
# drafting's estimate often dips below plain's, and charging each dip's probes more (a
# variant tried and not kept) drafted fewer rounds where drafting pays narrowly. Replayed
# on the default's real acceptance with this threshold, the guard does as well as before
# where drafting pays (bench/results/cpu-guard-replay/far-loser-*.md).
FAR_LOSER = 0.5

# The vocabulary of GuardDecision.reason.
EXPLORE = "explore"
DRAFTING_FASTER = "drafting faster"
DRAFTING_NOT_FASTER = "drafting not faster"
PROBE = "probe"


@dataclass(frozen=True)
class GuardDecision:
    """What the guard decided for one round, and the evidence it decided on.

    `reason` is one of EXPLORE, DRAFTING_FASTER, DRAFTING_NOT_FASTER, PROBE; `probe` is true for
    a round that runs the choice currently measured slower.
    """

    draft: bool
    probe: bool
    band: Band
    drafted_tps: float | None
    plain_tps: float | None
    reason: str


def lost_seconds(seconds: float, tokens: float, winner_tps: float) -> float:
    """The time a round of `seconds` that emitted `tokens` lost against a choice that
    emits `winner_tps` tokens a second: all of it against a winner that emits nothing."""
    return max(0.0, seconds - tokens / winner_tps) if winner_tps > 0 else seconds


def probe_charge(lost: float, drafted_tps: float, plain_tps: float, drafted: bool = True) -> float:
    """What a probe that lost `lost` seconds is charged against the budget: its loss, a
    drafted probe's scaled by FAR_LOSER x plain_tps / drafted_tps where that exceeds 1
    (`drafted_tps` > 0: a recorded round emits a token for each live lane)."""
    return lost * max(1.0, FAR_LOSER * plain_tps / drafted_tps) if drafted else lost


@dataclass
class _Throughput:
    """Decayed sums of one choice's rounds in one band."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed count of rounds
    rounds: int = 0  # undecayed count of rounds
    warm: int = 0  # rounds run but not counted (see warm_rounds)

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.seconds if self.rounds else None

    @property
    def mean_round_seconds(self) -> float:
        return self.seconds / self.weight

    def mean_loss_seconds(self, winner_tps: float) -> float:
        """What one of these rounds loses, on average, against a choice at `winner_tps`."""
        return lost_seconds(self.seconds, self.tokens, winner_tps) / self.weight

    def decay(self, keep: float) -> None:
        # Decay leaves the ratios alone; it only stops before underflow makes them 0/0.
        if self.weight < 1e-9:
            return
        self.tokens *= keep
        self.seconds *= keep
        self.weight *= keep

    def add(self, seconds: float, tokens: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.weight += 1.0
        self.rounds += 1


@dataclass
class _BandEvidence:
    drafted: _Throughput = field(default_factory=_Throughput)
    plain: _Throughput = field(default_factory=_Throughput)
    seconds: float = 0.0
    probe_seconds: float = 0.0
    probe_loss_seconds: float = 0.0  # what probes lost against the winner
    probe_charge_seconds: float = 0.0  # the budget's measure: probe losses, drafted ones scaled (module doc)
    probe_rounds: int = 0
    probe_share: float = 0.0  # decayed share of recent rounds that were probes

    def drafting_wins(self) -> bool:
        return self.drafted.tokens_per_second > self.plain.tokens_per_second


class DraftGuard:
    """Decides per round whether to draft, from realised throughput per band (see module doc)."""

    def __init__(self, budget: float = 0.02, smoothing: float = 0.05, explore_rounds: int = 3, outlier_factor: float = 4.0,
                 warm_rounds: int = 1, max_probe_share: float = 0.25) -> None:
        """`budget`: the share of a band's seconds that probes of drafting may be charged;
        `smoothing`: the per-round decay of old evidence; `explore_rounds`: counted rounds
        of each choice a new band runs; `outlier_factor`: the most a round counts, in its
        choice's mean round times; `warm_rounds`: the rounds of each choice a band runs
        uncounted first; `max_probe_share`: the most of a band's recent rounds that may be
        probes."""
        if not 0.0 < budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        if not 0.0 < max_probe_share <= 1.0:
            raise ValueError(f"max_probe_share must be in (0, 1], got {max_probe_share}")
        self.max_probe_share = max_probe_share
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if explore_rounds < 1:
            raise ValueError(f"explore_rounds must be at least 1, got {explore_rounds}")
        self._budget = budget
        self.smoothing = smoothing
        self._keep = 1.0 - smoothing
        self._explore_rounds = explore_rounds
        if not outlier_factor > 1.0:
            raise ValueError(f"outlier_factor must be above 1, got {outlier_factor}")
        self._outlier_factor = outlier_factor
        if warm_rounds < 0:
            raise ValueError(f"warm_rounds cannot be negative, got {warm_rounds}")
        self._warm_rounds = warm_rounds
        self._bands: dict[Band, _BandEvidence] = {}
        self._lock = threading.Lock()  # snapshot() is read from other threads

    @property
    def budget(self) -> float:
        """The share of a band's seconds that probes of drafting may be charged (their
        losses, scaled up where drafting loses by far; see the module doc)."""
        return self._budget

    def decide(self, lanes: int, context_tokens: int) -> GuardDecision:
        """Whether the next round of `lanes` decoding lanes at `context_tokens` tokens of
        context (pass the same measure everywhere, e.g. the longest lane's) should draft.
        Changes nothing: evidence only moves in `record`."""
        band = Band.of(lanes, context_tokens)
        with self._lock:
            return self._decide(band, lanes, context_tokens)

    def _decide(self, band: Band, lanes: int, context_tokens: int) -> GuardDecision:
        evidence = self._bands.get(band, _BandEvidence())
        drafted, plain = evidence.drafted, evidence.plain
        if drafted.rounds < self._explore_rounds:
            draft, probe, reason = True, False, EXPLORE
        elif plain.rounds < self._explore_rounds:
            draft, probe, reason = False, False, EXPLORE
        else:
            drafting_wins = evidence.drafting_wins()
            winner, loser = (drafted, plain) if drafting_wins else (plain, drafted)
            probe = self._probe_due(evidence, loser, winner.tokens_per_second, drafting=not drafting_wins)
            draft = drafting_wins != probe
            reason = PROBE if probe else DRAFTING_FASTER if drafting_wins else DRAFTING_NOT_FASTER
        decision = GuardDecision(draft, probe, band, drafted.tokens_per_second, plain.tokens_per_second, reason)
        if logger.isEnabledFor(logging.DEBUG):  # every round: its arguments cost host time even when not logged
            logger.debug(
                "guard decide lanes=%d context_tokens=%d band=%s draft=%s probe=%s reason=%r "
                "drafted_tps=%s plain_tps=%s drafted_rounds=%d plain_rounds=%d probe_seconds=%.6f band_seconds=%.6f",
                lanes, context_tokens, band, draft, probe, reason,
                _format_tps(decision.drafted_tps), _format_tps(decision.plain_tps),
                drafted.rounds, plain.rounds, evidence.probe_seconds, evidence.seconds,
            )
        return decision

    def record(self, decision: GuardDecision, round_seconds: float, emitted_tokens: float) -> None:
        """Fold in a round that ran as `decision` said: its wall seconds (drafter forward
        included) and the tokens it emitted over all its lanes, counted at its band's
        smallest lane count (module doc)."""
        if not round_seconds > 0.0:
            raise ValueError(f"a round takes positive time, got {round_seconds}")
        if emitted_tokens < 0:
            raise ValueError(f"emitted tokens cannot be negative, got {emitted_tokens}")
        with self._lock:
            self._record(decision, round_seconds, emitted_tokens)

    def _record(self, decision: GuardDecision, round_seconds: float, emitted_tokens: float) -> None:
        evidence = self._bands.setdefault(decision.band, _BandEvidence())
        choice = evidence.drafted if decision.draft else evidence.plain
        evidence.seconds += round_seconds
        evidence.probe_share = self._keep * evidence.probe_share + (1.0 - self._keep) * decision.probe
        if choice.warm < self._warm_rounds:
            choice.warm += 1
            return
        evidence.drafted.decay(self._keep)
        evidence.plain.decay(self._keep)
        counted = min(round_seconds, self._outlier_factor * choice.mean_round_seconds) if choice.weight > 1e-9 else round_seconds
        choice.add(counted, emitted_tokens)
        if decision.probe:
            winner_tps = decision.plain_tps if decision.draft else decision.drafted_tps
            evidence.probe_seconds += round_seconds
            lost = lost_seconds(round_seconds, emitted_tokens, winner_tps)
            evidence.probe_loss_seconds += lost
            evidence.probe_charge_seconds += probe_charge(lost, decision.drafted_tps, decision.plain_tps, decision.draft)
            evidence.probe_rounds += 1

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per band (keyed by str(band)), plain values for metrics export; `drafting` is the
        band's choice for its next round that is not a probe."""
        report = {}
        with self._lock:
            bands = sorted(self._bands.items())
            for band, evidence in bands:
                report[str(band)] = self._band_report(band, evidence)
        return report

    def _band_report(self, band: Band, evidence: _BandEvidence) -> dict[str, object]:
        explored = min(evidence.drafted.rounds, evidence.plain.rounds) >= self._explore_rounds
        return {
            "lanes": band.lanes_label,
            "context": band.context_label,
            "drafting": evidence.drafting_wins() if explored else evidence.drafted.rounds < self._explore_rounds,
            "drafting_wins": evidence.drafting_wins() if explored else None,
            "drafted_tps": evidence.drafted.tokens_per_second,
            "plain_tps": evidence.plain.tokens_per_second,
            "drafted_rounds": evidence.drafted.rounds,
            "plain_rounds": evidence.plain.rounds,
            "probe_rounds": evidence.probe_rounds,
            "probe_seconds": evidence.probe_seconds,
            "probe_loss_seconds": evidence.probe_loss_seconds,
            "seconds": evidence.seconds,
        }

    def _probe_due(self, evidence: _BandEvidence, loser: _Throughput, winner_tps: float, drafting: bool) -> bool:
        """Whether the next round probes `loser` (`drafting`: the loser is drafting)."""
        if evidence.probe_share >= self.max_probe_share:
            return False
        if not drafting:
            return loser.weight < STALE_WEIGHT
        expected_charge = probe_charge(loser.mean_loss_seconds(winner_tps), loser.tokens_per_second, winner_tps)
        return evidence.probe_charge_seconds + expected_charge <= self._budget * (evidence.seconds + loser.mean_round_seconds)


def _format_tps(tps: float | None) -> str:
    return "none" if tps is None else f"{tps:.3f}"

"""Pricing verify windows: chain chances, the measured cost of a round, the prefix scheduler.

A drafting lane verifies `1 + d` rows (its anchor and d drafts) and expects to emit
`1 + a_1 + ... + a_d` tokens, where `a_k` is the chance that drafts 1..k all survive.
The scheduler picks every lane's d before the target runs so that expected tokens per
second of the whole round is as high as the prefix rule allows.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence

from lanes.bands import Band


def chain_chances(confidences: Sequence[float]) -> list[float]:
    """a_k = c_1 * ... * c_k: the chance that drafts 1..k all survive.

    Each c_k is the chance that draft k survives given that the ones before it did.
    """
    chances = []
    survival = 1.0
    for k, confidence in enumerate(confidences, start=1):
        if not 0.0 <= confidence <= 1.0:
            raise ValueError(f"confidence {k} is {confidence}, not a probability")
        survival *= confidence
        chances.append(survival)
    return chances


# The prior of CountedChances, as survived and failed pseudo-counts: optimistic (0.75), so
# a source gets tried (lookup against a drafter of good yield) and its chances learned.
PRIOR_SURVIVED, PRIOR_FAILED = 3, 1


class CountedChances:
    """Survival of drafts by source and position, counted from verify outcomes over a
    prior: c_sk = (survived + 3) / (verified + 4), the chance that draft k of source s
    survives given that drafts 1..k-1 did. Source n >= 1 is a lookup after a match of n
    tokens (lanes/lookup.py); source 0 is the drafter, priced by these counts where the
    round verifies its proposal before reading its confidences."""

    def __init__(self, sources: int, positions: int):
        self._survived = [[0] * positions for _ in range(sources)]
        self._verified = [[0] * positions for _ in range(sources)]

    def confidences(self, source: int, depth: int) -> list[float]:
        """c_s1..c_s,depth."""
        prior = PRIOR_SURVIVED + PRIOR_FAILED
        return [(s + PRIOR_SURVIVED) / (v + prior) for s, v in zip(self._survived[source][:depth], self._verified[source][:depth])]

    def observe(self, source: int, verified_depth: int, accepted: int) -> None:
        """Drafts 1..accepted survived; draft accepted+1 failed if it was verified."""
        if not 0 <= accepted <= verified_depth <= len(self._verified[source]):
            raise ValueError(f"need 0 <= accepted ({accepted}) <= verified_depth ({verified_depth}) <= {len(self._verified[source])}")
        for k in range(min(accepted + 1, verified_depth)):
            self._verified[source][k] += 1
            self._survived[source][k] += k < accepted


class NoCostData(LookupError):
    """The cost table has no measurement to estimate from (seed it with a warm-up profile)."""


def monotone_fit(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` by least squares weighted by `weights`
    (pool adjacent violators): each run of values that falls is replaced by its weighted
    mean."""
    pools: list[tuple[float, float, int]] = []  # (mean, weight, values pooled)
    for value, weight in zip(values, weights, strict=True):
        pools.append((value, weight, 1))
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (later, later_weight, later_count), (earlier, earlier_weight, earlier_count) = pools.pop(), pools.pop()
            total = earlier_weight + later_weight
            pools.append(((earlier * earlier_weight + later * later_weight) / total, total, earlier_count + later_count))
    return [mean for mean, _, count in pools for _ in range(count)]


def cost_curve(seconds_by_rows: Mapping[int, float], rounds_by_rows: Mapping[int, float] | None = None) -> Callable[[int], float]:
    """Seconds of a round of `rows` rows, as a function of rows, from the measured seconds
    of some row counts (read once: a round's pricing asks about many row counts).

    Measurements are first fitted non-decreasing in rows (a round of more rows never costs
    less), each weighted by the rounds it rests on (`rounds_by_rows`; one each when not
    given), so a row count measured once and high is pooled with the wider ones measured
    often rather than pricing them all as dearly. A running maximum did the latter: in
    session 35's served run one 100-row round of 35 ms, never measured again, priced
    every 15-lane window at 4 rows, where 10 took 19.7 ms against 16.3.
    Between measured row counts the estimate is linear between the two neighbours only,
    so a staircase with a cliff stays a staircase; below the smallest measured count it
    is flat; above the largest it continues the slope of the last two measured counts
    (flat with a single measurement), never below the last.
    """
    if not seconds_by_rows:
        raise NoCostData("no measured row counts")
    measured = sorted(seconds_by_rows)
    weights = [1.0 if rounds_by_rows is None else rounds_by_rows.get(r, 1.0) for r in measured]
    seconds = monotone_fit([seconds_by_rows[r] for r in measured], weights)
    slope = (seconds[-1] - seconds[-2]) / (measured[-1] - measured[-2]) if len(measured) > 1 else 0.0

    def estimate(rows: int) -> float:
        if rows >= measured[-1]:
            return seconds[-1] + slope * (rows - measured[-1])
        if rows <= measured[0]:
            return seconds[0]
        i = bisect_left(measured, rows)
        if measured[i] == rows:
            return seconds[i]
        share = (rows - measured[i - 1]) / (measured[i] - measured[i - 1])
        return seconds[i - 1] + share * (seconds[i] - seconds[i - 1])

    return estimate


class CostTable:
    """Measured seconds of a target round by row count, per (lanes band, context band).
    (The drafter's own seconds are this round's, measured before the windows are priced.)

    Seeded by a warm-up profile (`seed`, or `seeds` at construction) and refined from
    live rounds (`observe`: an exponential moving average per measured key, which rests
    on the rounds it has taken, up to the 1 / smoothing it remembers; `cost_curve`
    weighs each key by them). A band with no measurements borrows the nearest measured
    band (fewest band steps; ties go to the larger band, whose cost is the safer guess).
    """

    def __init__(
        self,
        smoothing: float = 0.1,
        seeds: Iterable[tuple[int, int, int, float]] = (),
    ) -> None:
        """`smoothing` is the weight of each live observation; `seeds` are
        (rows, lanes, context_tokens, seconds) warm-up measurements."""
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self._smoothing = smoothing
        self._round_seconds: dict[Band, dict[int, float]] = {}
        self._rounds: dict[Band, dict[int, int]] = {}  # the rounds each figure rests on
        for rows, lanes, context_tokens, seconds in seeds:
            self.seed(rows, lanes, context_tokens, seconds)

    def seed(self, rows: int, lanes: int, context_tokens: int, seconds: float) -> None:
        """Set the cost of `rows` rows in this band from a warm-up measurement."""
        _check_measurement(rows, seconds)
        band = Band.of(lanes, context_tokens)
        self._round_seconds.setdefault(band, {})[rows] = seconds
        self._rounds.setdefault(band, {})[rows] = 1

    def observe(self, rows: int, lanes: int, context_tokens: int, seconds: float) -> None:
        """Fold a live round's seconds into the cost of `rows` rows in this band."""
        _check_measurement(rows, seconds)
        band = Band.of(lanes, context_tokens)
        by_rows, rounds = self._round_seconds.setdefault(band, {}), self._rounds.setdefault(band, {})
        by_rows[rows] = self._smoothed(by_rows.get(rows), seconds)
        rounds[rows] = min(rounds.get(rows, 0) + 1, round(1 / self._smoothing))

    def estimate(self, rows: int, lanes: int, context_tokens: int) -> float:
        """Estimated seconds of a target round of `rows` rows (see `cost_curve`)."""
        return self.curve(lanes, context_tokens)(rows)

    def curve(self, lanes: int, context_tokens: int) -> Callable[[int], float]:
        """Estimated seconds of a target round by its rows, for rounds of `lanes` lanes at
        `context_tokens` tokens (see `cost_curve`)."""
        band = _nearest(self._round_seconds, Band.of(lanes, context_tokens))
        return cost_curve(self._round_seconds[band], self._rounds[band])

    def plain_estimate(self, lanes: int, context_tokens: int) -> float:
        """Estimated seconds of a plain round of `lanes` lanes (one row each), from the
        nearest band that has measured a round of no more rows. A band that has run only
        wider verifies would price it flat at its narrowest verify, which on the CPU costs
        several plain rows: the guard, counting a band's tokens by these (lanes/guard.py),
        would weigh its lane counts as if a round cost the same at any of them."""
        fitting = {band: by_rows for band, by_rows in self._round_seconds.items() if min(by_rows) <= lanes}
        band = _nearest(fitting or self._round_seconds, Band.of(lanes, context_tokens))
        return cost_curve(self._round_seconds[band], self._rounds[band])(lanes)

    def figures(self) -> dict[Band, dict[int, tuple[float, int]]]:
        """What the table holds, for reports: per band, each row count's seconds and the
        rounds they rest on."""
        return {band: {rows: (seconds, self._rounds[band][rows]) for rows, seconds in sorted(by_rows.items())}
                for band, by_rows in self._round_seconds.items()}

    def _smoothed(self, previous: float | None, seconds: float) -> float:
        if previous is None:
            return seconds
        return previous + self._smoothing * (seconds - previous)


def _check_measurement(rows: int, seconds: float) -> None:
    if rows < 1:
        raise ValueError(f"a round has at least one row, got {rows}")
    if not seconds > 0.0:
        raise ValueError(f"a measured time must be positive, got {seconds}")


def _nearest(measured: Mapping[Band, object], band: Band) -> Band:
    if band in measured:
        return band
    if not measured:
        raise NoCostData(f"nothing measured for {band} or any other band")
    return min(measured, key=lambda other: (band.distance(other), -other.context, -other.lanes))


def plan_depths(
    chances_per_lane: Sequence[Sequence[float]],
    plain_rows: int,
    round_seconds: Callable[[int], float],
    draft_seconds: float,
    max_depths: Sequence[int] | None = None,
    padded_width: Callable[[int], int] | None = None,
) -> list[int]:
    """Verify depth per drafting lane: the DSpark prefix scheduler.

    Every drafting lane starts at depth 0 (its anchor row, one sure token); plain lanes
    add `plain_rows` rows and as many tokens. Candidates (lane r, draft k) are admitted
    in order of chain chance a_rk, highest first (ties by k, so a lane's drafts enter in
    prefix order), each adding one row and a_rk expected tokens; the plan is the prefix
    of that order with the highest estimated rate tokens / (round_seconds(rows) +
    draft_seconds) (the shortest, on a tie).

    DSpark stops at the first candidate that lowers the rate, because with rejection
    sampling a window chosen from this round's confidences past that point would bias
    what is emitted. Here a kept draft is one that equals the target's own draw at its
    position (greedy or seeded Gumbel), so no choice of depth changes a token and the
    best prefix is as exact as the first; it also crosses a step in the cost (a noisy
    row count, or a real cliff) that the first-drop rule would stop at.

    `chances_per_lane[r]` are lane r's chain chances (non-increasing, one per proposal);
    `max_depths[r]`, if given, caps lane r's depth further (e.g. tokens it may still emit).
    `padded_width`, where rounds keep steady shapes: every lane of the round, plain ones
    too, feeds the widest window's rows padded to `padded_width(rows)`, so a round costs
    `round_seconds(lanes * padded_width(1 + deepest))`: a draft that does not widen the
    padded window costs nothing more, and a bucket once paid for is filled.
    """
    if plain_rows < 0:
        raise ValueError(f"plain_rows cannot be negative, got {plain_rows}")
    if max_depths is not None and len(max_depths) != len(chances_per_lane):
        raise ValueError(f"{len(max_depths)} max depths for {len(chances_per_lane)} lanes")

    candidates = []
    for lane, chances in enumerate(chances_per_lane):
        if any(later > earlier for earlier, later in zip(chances, chances[1:])):
            raise ValueError(f"lane {lane}: chain chances must be non-increasing, got {list(chances)}")
        depth_cap = len(chances) if max_depths is None else min(len(chances), max_depths[lane])
        candidates.extend((chance, k, lane) for k, chance in enumerate(chances[:depth_cap], start=1))
    candidates.sort(key=lambda candidate: (-candidate[0], candidate[1], candidate[2]))

    def rate(tokens: float, rows: int) -> float:
        seconds = round_seconds(rows) + draft_seconds
        if not seconds > 0.0:
            raise ValueError(f"a round of {rows} rows cannot take {seconds} seconds")
        return tokens / seconds

    lanes = len(chances_per_lane) + plain_rows

    def fed(rows: int, deepest: int) -> int:
        """The rows the round feeds: its windows' own, or every lane's padded to the deepest."""
        return rows if padded_width is None else lanes * padded_width(1 + deepest)

    depths = [0] * len(chances_per_lane)
    if not candidates:
        return depths
    rows, deepest = lanes, 0
    tokens = float(rows)
    best, admitted = rate(tokens, fed(rows, deepest)), 0
    for count, (chance, k, _) in enumerate(candidates, start=1):
        rows += 1
        deepest = max(deepest, k)
        tokens += chance
        widened = rate(tokens, fed(rows, deepest))
        if widened > best:
            best, admitted = widened, count
    for _, k, lane in candidates[:admitted]:
        depths[lane] = max(depths[lane], k)
    return depths

"""Pricing: chain chances, the cost table, the prefix scheduler."""

import numpy as np
import pytest

from families.lfm2 import open_target
from families.lfm2.cache import row_bucket
from families.lfm2.drafter import load_drafter
from lanes.detokenize import IncrementalDetokenizer
from lanes.lane import Lane, Request
from lanes.pricing import (
    CostTable,
    NoCostData,
    chain_chances,
    cost_curve,
    monotone_fit,
    plan_depths,
)
from lanes.round import Draft, RoundRunner


def linear_cost(fixed, per_row):
    return lambda rows: fixed + per_row * rows


# --- chain chances and windows -------------------------------------------------------


def test_chain_chances_are_running_products():
    # 0.9; 0.9*0.8 = 0.72; 0.72*0.5 = 0.36
    assert chain_chances([0.9, 0.8, 0.5]) == pytest.approx([0.9, 0.72, 0.36])
    assert chain_chances([]) == []


@pytest.mark.parametrize("bad", [1.2, -0.1, float("nan")])
def test_chain_chances_refuse_non_probabilities(bad):
    with pytest.raises(ValueError):
        chain_chances([0.5, bad])


def test_interpolation_is_linear_between_neighbours_only():
    points = {1: 10.0, 8: 12.0, 10: 20.0}
    assert cost_curve(points)(1) == 10.0
    assert cost_curve(points)(4) == pytest.approx(10.0 + 3 / 7 * 2.0)  # 3/7 of the way 10 -> 12
    assert cost_curve(points)(9) == pytest.approx(16.0)  # halfway 12 -> 20
    assert cost_curve(points)(10) == 20.0


def test_interpolation_keeps_the_metal_cliff():
    # Flat to 9 rows, a cliff at 10, flat again: no smoothing across the cliff.
    points = {1: 10.0, 8: 10.4, 9: 10.5, 10: 18.0, 16: 18.6}
    assert cost_curve(points)(9) == 10.5
    assert cost_curve(points)(10) == 18.0
    assert cost_curve(points)(13) == pytest.approx(18.3)


def test_extrapolation_continues_the_last_slope():
    points = {1: 10.0, 8: 12.0, 10: 20.0}
    assert cost_curve(points)(12) == pytest.approx(28.0)  # slope (20-12)/2 = 4 per row


def test_extrapolation_never_falls_below_the_last_point():
    # The dip 12 -> 11 is noise: the fit pools the two, 10, 11.5, 11.5, so the slope past 3 is 0.
    points = {1: 10.0, 2: 12.0, 3: 11.0}
    assert cost_curve(points)(1) == 10.0
    assert cost_curve(points)(2) == 11.5
    assert cost_curve(points)(3) == 11.5
    assert cost_curve(points)(6) == 11.5


def test_a_fall_in_the_measurements_is_pooled_by_the_rounds_each_rests_on():
    # One round of 100 rows at 35 ms against ten rounds each of the wider counts at about
    # 18: all three are priced near 18, not the wider ones at 35.
    points = {60: 16.0, 100: 35.0, 120: 17.5, 150: 18.0}
    rounds = {60: 10, 100: 1, 120: 10, 150: 10}
    curve = cost_curve(points, rounds)
    assert curve(60) == 16.0
    assert curve(100) == curve(120) == curve(150) == pytest.approx((35.0 + 10 * 17.5 + 10 * 18.0) / 21)
    # Unweighted, the one round weighs as much as ten.
    assert cost_curve(points)(150) == pytest.approx((35.0 + 17.5 + 18.0) / 3)


@pytest.mark.parametrize("seed", range(5))
def test_the_monotone_fit_is_the_nearest_non_decreasing_sequence(seed):
    rng = np.random.default_rng(seed)
    values, weights = rng.uniform(1, 5, 8), rng.integers(1, 10, 8).astype(float)
    fit = np.array(monotone_fit(list(values), list(weights)))
    assert np.all(np.diff(fit) >= -1e-12)
    assert np.sum(weights * fit) == pytest.approx(np.sum(weights * values))  # each pool keeps its weighted mean
    best = np.sum(weights * (fit - values) ** 2)
    for _ in range(200):  # no other non-decreasing sequence is nearer
        other = np.sort(fit + rng.normal(0, 0.2, 8))
        assert np.sum(weights * (other - values) ** 2) >= best - 1e-9


def test_single_point_is_flat_and_below_first_point_is_flat():
    assert cost_curve({4: 7.0})(1) == 7.0
    assert cost_curve({4: 7.0})(10) == 7.0
    assert cost_curve({4: 7.0, 8: 9.0})(2) == 7.0


def test_interpolation_is_monotone_in_rows_for_noisy_points():
    rng = np.random.default_rng(0)
    points = {int(r): float(s) for r, s in zip(rng.choice(64, 12, replace=False) + 1, rng.uniform(1, 5, 12))}
    estimates = [cost_curve(points)(rows) for rows in range(1, 100)]
    assert all(later >= earlier for earlier, later in zip(estimates, estimates[1:]))


# --- cost table ---------------------------------------------------------------------------


def test_cost_table_seeds_and_smooths_live_observations():
    table = CostTable(smoothing=0.1, seeds=[(4, 1, 1000, 10.0), (8, 1, 1000, 14.0)])
    assert table.estimate(6, 1, 1000) == pytest.approx(12.0)
    table.observe(4, 1, 1000, 20.0)  # 10 + 0.1 * (20 - 10) = 11
    assert table.estimate(4, 1, 1000) == pytest.approx(11.0)
    table.observe(2, 1, 1000, 9.0)  # first measurement of 2 rows is taken as is
    assert table.estimate(2, 1, 1000) == 9.0
    table.seed(4, 1, 1000, 10.0)  # a seed overwrites
    assert table.estimate(4, 1, 1000) == 10.0


def test_a_row_count_measured_once_high_does_not_price_the_wider_windows():
    # Session 35's served run: a 15-lane band's rounds of 60 and 150 rows measured often,
    # one round of 100 rows (10 lanes, a join in its interval) at 35 ms, never again.
    table = CostTable(smoothing=0.1)
    table.observe(100, 10, 200, 0.035)
    for _ in range(30):
        table.observe(60, 15, 200, 0.0163)
        table.observe(150, 15, 200, 0.0197)
    assert table.estimate(150, 15, 200) == pytest.approx((0.035 + 10 * 0.0197) / 11)  # the 150-row figure rests on 10
    chances = [[0.865 * 0.8**k for k in range(9)]] * 15  # deep chains, as at the published profile
    depths = plan_depths(chances, 0, table.curve(15, 200), 0.001, padded_width=lambda rows: 4 if rows <= 4 else 10)
    assert max(depths) == 9


def test_cost_table_keeps_bands_apart():
    table = CostTable(seeds=[(2, 1, 1000, 10.0), (2, 16, 1000, 30.0), (2, 1, 100_000, 50.0)])
    assert table.estimate(2, 1, 2048) == 10.0
    assert table.estimate(2, 20, 2000) == 30.0
    assert table.estimate(2, 1, 70_000) == 50.0  # 70K and 100K share the <=128K band


def test_cost_table_borrows_the_nearest_band_preferring_larger():
    table = CostTable(seeds=[(2, 1, 1000, 10.0), (2, 4, 1000, 20.0), (2, 16, 100_000, 90.0)])
    # (2 lanes, 4K) is 2 steps from both (1, 2K) and (4, 2K): the larger band's cost wins.
    assert table.estimate(2, 2, 3000) == 20.0
    # (1 lane, 2K) exists: no borrowing even though others are near.
    assert table.estimate(2, 1, 10) == 10.0
    # (16 lanes, 64K) is one context step from (16, 128K).
    assert table.estimate(2, 16, 60_000) == 90.0


def test_a_plain_round_is_priced_from_the_nearest_band_that_ran_one_as_narrow():
    # A band that has verified only 9-row windows (10 ms) has not measured a plain round of
    # 2 lanes; its neighbour of 1 lane at the same context has measured 1 and 2 rows.
    table = CostTable(seeds=[(1, 1, 1000, 2.0), (2, 1, 1000, 3.0), (18, 2, 1000, 10.0)])
    assert table.estimate(2, 2, 1000) == 10.0  # the band's own curve, flat below its narrowest verify
    assert table.plain_estimate(2, 1000) == 3.0
    table.observe(2, 2, 1000, 4.0)  # once the band runs one, its own measurement prices it
    assert table.plain_estimate(2, 1000) == 4.0
    assert table.plain_estimate(3, 1000) == pytest.approx(4.0 + (3 - 2) * (10.0 - 4.0) / (18 - 2))
    # With no band as narrow, the nearest band's curve as for any estimate.
    assert CostTable(seeds=[(9, 1, 1000, 5.0)]).plain_estimate(1, 1000) == 5.0
    with pytest.raises(NoCostData):
        CostTable().plain_estimate(1, 1000)


def test_empty_cost_table_says_so():
    with pytest.raises(NoCostData):
        CostTable().estimate(1, 1, 1000)


def test_cost_table_refuses_bad_measurements():
    table = CostTable()
    with pytest.raises(ValueError):
        table.observe(0, 1, 1000, 1.0)
    with pytest.raises(ValueError):
        table.seed(1, 1, 1000, 0.0)
    with pytest.raises(ValueError):
        CostTable(smoothing=0.0)


# --- the prefix scheduler: hand-computed cases -----------------------------------------


def test_one_lane_takes_its_best_depth():
    # T(B) = 1 + 0.5 B, no drafter time, chances 0.9, 0.72, 0.36.
    # depth 0: 1.00 / 1.5 = 0.6667
    # depth 1: 1.90 / 2.0 = 0.9500
    # depth 2: 2.62 / 2.5 = 1.0480  best
    # depth 3: 2.98 / 3.0 = 0.9933
    assert plan_depths([[0.9, 0.72, 0.36]], 0, linear_cost(1.0, 0.5), 0.0) == [2]


def test_lanes_compete_for_rows_by_chain_chance():
    # Lanes A [0.8, 0.4], B [0.6, 0.5], 2 plain rows, T(B) = 1 + 0.25 B, drafter 0.5.
    # start: rows 4, tokens 4, 4.0 / (2.00 + 0.5) = 1.6000
    # A1 (0.8): 4.8 / (2.25 + 0.5) = 1.7455  rises
    # B1 (0.6): 5.4 / (2.50 + 0.5) = 1.8000  rises
    # B2 (0.5): 5.9 / (2.75 + 0.5) = 1.8154  rises
    # A2 (0.4): 6.3 / (3.00 + 0.5) = 1.8000  lower: the best prefix ends at B2
    assert plan_depths([[0.8, 0.4], [0.6, 0.5]], 2, linear_cost(1.0, 0.25), 0.5) == [1, 2]


def test_max_depths_cap_lanes():
    # As above with B capped at 1: A1 1.7455, B1 1.8000 (best), then A2: 5.8 / 3.25 = 1.7846.
    assert plan_depths([[0.8, 0.4], [0.6, 0.5]], 2, linear_cost(1.0, 0.25), 0.5, max_depths=[2, 1]) == [1, 1]
    assert plan_depths([[0.9, 0.8]], 0, lambda rows: 1.0, 0.0, max_depths=[0]) == [0]


def test_a_cliff_in_the_cost_does_not_end_the_scan():
    # Cost 1.0 up to 2 rows, a cliff to 1.5 from 3 rows on.
    # depth 0: 1.00 / 1.0 = 1.000
    # depth 1: 1.90 / 1.0 = 1.900
    # depth 2: 2.75 / 1.5 = 1.833  lower (the first-drop rule would stop at 1)
    # depth 4: 4.30 / 1.5 = 2.867  best
    chances = chain_chances([0.9, 0.85 / 0.9, 0.8 / 0.85, 0.75 / 0.8])
    def cost(rows):
        return 1.0 if rows <= 2 else 1.5
    assert plan_depths([chances], 0, cost, 0.0) == [4]


def test_ties_enter_in_prefix_order():
    # A [0.5, 0.5] and B [0.5] tie everywhere; the rows budget allows two drafts (free up to
    # 4 rows, then dear). Ties go by k, so both lanes' first drafts enter before A's second.
    def cost(rows):
        return 1.0 if rows <= 4 else 100.0
    assert plan_depths([[0.5, 0.5], [0.5]], 0, cost, 0.0) == [1, 1]


def test_zero_chance_drafts_are_never_verified_even_when_free():
    assert plan_depths([[0.9, 0.0, 0.0]], 3, lambda rows: 1.0, 0.0) == [1]


def test_nothing_to_price():
    calls = []
    def cost(rows):
        calls.append(rows)
        return 1.0
    assert plan_depths([], 5, cost, 0.1) == []
    assert plan_depths([[], []], 0, cost, 0.1) == [0, 0]
    assert calls == []


def test_scheduler_refuses_bad_input():
    with pytest.raises(ValueError):
        plan_depths([[0.5, 0.6]], 0, lambda rows: 1.0, 0.0)  # chances must not rise
    with pytest.raises(ValueError):
        plan_depths([[0.5]], -1, lambda rows: 1.0, 0.0)
    with pytest.raises(ValueError):
        plan_depths([[0.5]], 0, lambda rows: 1.0, 0.0, max_depths=[1, 1])
    with pytest.raises(ValueError):
        plan_depths([[0.5]], 0, lambda rows: 0.0, 0.0)


def test_steady_shapes_price_the_padded_window():
    """Where every lane feeds the widest window padded to a bucket (1, 2, 4, 8, 9 rows),
    the plan fills the bucket it pays for and, judged by what padded rounds cost, beats
    the plan priced by real rows."""
    bucket = lambda rows: row_bucket(rows, 9)
    chances = chain_chances([0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    gained = []
    for slope in (0.05, 0.1, 0.2, 0.3):
        cost = linear_cost(1.0, slope)
        by_rows = plan_depths([chances], 0, cost, 0.0)
        padded = plan_depths([chances], 0, cost, 0.0, padded_width=bucket)
        assert 1 + padded[0] in (1, 2, 4, 8, 9)
        rate = lambda depths: (1 + sum(chances[: depths[0]])) / cost(bucket(1 + depths[0]))
        assert rate(padded) >= rate(by_rows)
        gained.append(rate(padded) > rate(by_rows))
    assert sum(gained) >= 2
    # Several lanes: all of them pay for the deepest window, plain ones too.
    two = [chances, chain_chances([0.95] * 8)]
    depths = plan_depths(two, 2, linear_cost(1.0, 0.01), 0.0, padded_width=bucket)
    assert depths == [8, 8]  # a 9-row window for 4 lanes costs 36 rows at 0.01 each: worth all 8 drafts


# --- the prefix scheduler: properties --------------------------------------------------


def random_chances(rng, lanes, width=9, mean_confidence=0.8):
    return [
        chain_chances(np.clip(rng.normal(mean_confidence, 0.15, width), 0.0, 1.0)) for _ in range(lanes)
    ]


def random_staircase(rng, rows=200):
    """A non-decreasing cost per row count with flat steps and cliffs, like Metal's."""
    steps = rng.uniform(0.0, 0.02, rows + 1) * (rng.random(rows + 1) < 0.3)
    steps[10::16] += rng.uniform(0.1, 0.5)  # cliffs every 16 rows from 10
    seconds = 1.0 + np.cumsum(steps)
    return lambda b: float(seconds[b])


def test_nearly_constant_cost_goes_deep_on_high_chances_and_shallow_on_low():
    cost = linear_cost(1.0, 0.01)
    high = chain_chances([0.95] * 9)
    assert plan_depths([high], 0, cost, 0.0) == [9]
    # Low confidences 0.05: a1 = 0.05, a2 = 0.0025.
    # depth 0: 1 / 1.01 = 0.9901; depth 1: 1.05 / 1.02 = 1.0294 best; depth 2: 1.0525 / 1.03 = 1.0218.
    assert plan_depths([chain_chances([0.05] * 9)], 0, cost, 0.0) == [1]


def test_depths_rise_with_chances_scaled_up_together():
    # Scaling all chances by s keeps the admission order, and each admission test
    # a_j > tau_{j-1} * (T_j / T_{j-1} - 1) with tau_{j-1} = tau_0 + S_{j-1} becomes
    # a_j > (tau_0 / s + S_{j-1}) * (...): easier as s grows. Powers of two scale exactly.
    rng = np.random.default_rng(1)
    for _ in range(300):
        chances = random_chances(rng, int(rng.integers(1, 17)))
        cost = random_staircase(rng)
        plain_rows = int(rng.integers(0, 8))
        draft = float(rng.uniform(0, 0.5))
        depths = plan_depths(chances, plain_rows, cost, draft)
        for scale in (0.5, 0.25):
            scaled = [[scale * a for a in lane] for lane in chances]
            lower = plan_depths(scaled, plain_rows, cost, draft)
            assert all(low <= high for low, high in zip(lower, depths))


def test_a_steeper_cost_never_deepens_windows():
    # T2 = T1 * h with h non-decreasing makes every step ratio T(B+1)/T(B) at least as
    # large, so every admission test is at least as hard.
    rng = np.random.default_rng(2)
    for _ in range(300):
        chances = random_chances(rng, int(rng.integers(1, 17)))
        cost = random_staircase(rng)
        growth = np.cumsum(rng.uniform(0.0, 0.05, 201)) + 1.0
        def steeper(b):
            return cost(b) * growth[b]
        plain_rows = int(rng.integers(0, 8))
        gentle = plan_depths(chances, plain_rows, cost, 0.0)
        steep = plan_depths(chances, plain_rows, steeper, 0.0)
        assert all(s <= g for s, g in zip(steep, gentle))


def test_a_dearer_drafter_never_shallows_windows():
    # A fixed drafter cost D shrinks each step ratio (T(B+1) + D) / (T(B) + D): rows are
    # relatively cheaper, so windows can only deepen.
    rng = np.random.default_rng(3)
    for _ in range(300):
        chances = random_chances(rng, int(rng.integers(1, 17)))
        cost = random_staircase(rng)
        cheap = plan_depths(chances, 2, cost, 0.05)
        dear = plan_depths(chances, 2, cost, 0.5)
        assert all(d >= c for c, d in zip(cheap, dear))


def test_raising_one_lanes_chance_can_push_another_lanes_draft_out():
    # The rule maximises a rate, not a depth: a better lane raises the rate that every
    # further row must beat. T(2) = 1, T(3) = 1.1, T(4) = 1.243 (steps of 10% and 13%).
    cost = {2: 1.0, 3: 1.1, 4: 1.243}.__getitem__
    # A 0.5, B 0.35: 2 / 1 = 2; A1: 2.5 / 1.1 = 2.2727; B1: 2.85 / 1.243 = 2.2928 best.
    assert plan_depths([[0.5], [0.35]], 0, cost, 0.0) == [1, 1]
    # A 0.9, B 0.35: 2 / 1 = 2; A1: 2.9 / 1.1 = 2.6364 best; B1: 3.25 / 1.243 = 2.6146.
    assert plan_depths([[0.9], [0.35]], 0, cost, 0.0) == [1, 0]


def test_plans_are_the_best_prefix_of_the_admission_order():
    rng = np.random.default_rng(4)
    for _ in range(300):
        chances = random_chances(rng, int(rng.integers(1, 17)))
        cost = random_staircase(rng)
        plain_rows = int(rng.integers(0, 8))
        draft = float(rng.uniform(0, 0.5))
        depths = plan_depths(chances, plain_rows, cost, draft)
        base_rows = len(chances) + plain_rows

        def rate(ds):
            rows = base_rows + sum(ds)
            return (base_rows + sum(sum(lane[:d]) for lane, d in zip(chances, ds))) / (cost(rows) + draft)

        # Every prefix of the admission order (chance descending, then k, then lane) rates
        # no higher than the plan, and the plan is one of them.
        order = sorted(((a, k, r) for r, lane in enumerate(chances) for k, a in enumerate(lane, start=1)),
                       key=lambda c: (-c[0], c[1], c[2]))
        prefix, plans = [0] * len(chances), [[0] * len(chances)]
        for _, k, r in order:
            prefix[r] = k
            plans.append(list(prefix))
        assert depths in plans
        assert all(rate(plan) <= rate(depths) + 1e-12 for plan in plans)


def test_a_round_with_steady_shapes_prices_its_padded_window(dense_dir, drafter_dir):
    """The lane core prices by the padded window where it pads (RoundRunner._price), from
    a cost table of padded rows: a drafter's chances that would stop at 5 drafts by real
    rows (6 rows, padded to 8) take 7 instead, and by real rows where it does not pad."""
    loaded = open_target(dense_dir, max_lanes=1)
    drafter = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, max_lanes=1)
    chances = chain_chances([0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    lane = Lane(Request([1, 2, 3], 64), loaded.eos_ids, loaded.target.context_limit, IncrementalDetokenizer(loaded.tokenizer.decode))
    depths = {}
    for steady in (True, False):
        runner = RoundRunner(loaded.target, drafter, steady_shapes=steady)
        for rows in (1, 2, 4, 8, 9):
            runner.costs.seed(rows, 1, lane.context, 1.0 + 0.05 * rows)
        depths[steady] = runner._price([lane], [lane], [Draft(None, chances[: runner.proposals])], 0.0)
    assert depths == {True: [7], False: [5]}

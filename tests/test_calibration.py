"""Calibration of the confidence head: temperature fits and the online calibrator."""

import math

import numpy as np
import pytest

from lanes.calibration import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    ConfidenceCalibrator,
    fit_temperature,
    logit,
    sigmoid,
)


def test_logit_is_clipped_to_stay_finite():
    # p clipped to 1e-6: log(1e-6 / (1 - 1e-6)) = -13.8155...
    assert logit(0.0) == pytest.approx(-13.81551, abs=1e-4)
    assert logit(1.0) == pytest.approx(13.81551, abs=1e-4)
    assert logit(0.5) == 0.0
    assert float(sigmoid(logit(0.8))) == pytest.approx(0.8)


def test_fit_temperature_hand_case():
    # One logit value z = 2 seen 4 times with 3 successes: the fit makes sigmoid(2 / T) = 3/4,
    # so 2 / T = logit(3/4) = ln 3 and T = 2 / ln 3 = 1.8205.
    assert fit_temperature([2.0] * 4, [1, 1, 1, 0]) == pytest.approx(2 / math.log(3), rel=1e-6)
    # Mirrored negatives with the mirrored outcome rate give the same temperature.
    assert fit_temperature([2.0] * 4 + [-2.0] * 4, [1, 1, 1, 0, 0, 0, 0, 1]) == pytest.approx(
        2 / math.log(3), rel=1e-6
    )


@pytest.mark.parametrize("true_temperature", [0.5, 1.6, 3.0])
def test_fit_temperature_recovers_a_known_temperature(true_temperature):
    # 20000 outcomes drawn with chance sigmoid(z / T): the fit's spread is about 2-3% of T
    # at this size (measured over 30 seeds); we allow 8%.
    rng = np.random.default_rng(7)
    z = rng.normal(0.5, 2.5, 20_000)
    outcomes = (rng.random(z.size) < sigmoid(z / true_temperature)).astype(int)
    assert fit_temperature(z, outcomes) == pytest.approx(true_temperature, rel=0.08)


def test_fit_temperature_lands_on_bounds_and_identity_for_degenerate_data():
    z = np.linspace(-3, 3, 40)
    assert fit_temperature(z, (z > 0).astype(int)) == MIN_TEMPERATURE  # separable: sharpen to the bound
    assert fit_temperature(z, (z < 0).astype(int)) == MAX_TEMPERATURE  # anti-correlated: flatten to the bound
    assert fit_temperature(np.zeros(10), [1, 0] * 5) == 1.0  # no signal in the logits


def test_fit_temperature_refuses_bad_input():
    with pytest.raises(ValueError):
        fit_temperature([], [])
    with pytest.raises(ValueError):
        fit_temperature([1.0, 2.0], [1])
    with pytest.raises(ValueError):
        fit_temperature([1.0], [2])
    with pytest.raises(ValueError):
        fit_temperature([float("inf")], [1])


def test_calibrator_is_the_identity_without_data():
    calibrator = ConfidenceCalibrator(positions=3)
    raw = [0.91, 0.37, 0.999999999]
    assert calibrator.calibrate(raw) == raw  # exactly, not through a logit round trip
    assert calibrator.temperatures == (1.0, 1.0, 1.0)


def test_observe_records_survivals_one_failure_and_nothing_beyond():
    calibrator = ConfidenceCalibrator(positions=4)
    calibrator.observe([0.9, 0.8, 0.7, 0.6], verified_depth=3, accepted=1)  # 1 survived, 2 failed
    assert calibrator.sample_counts == (1, 1, 0, 0)
    calibrator.observe([0.9, 0.8, 0.7, 0.6], verified_depth=3, accepted=3)  # all verified survived
    assert calibrator.sample_counts == (2, 2, 1, 0)
    calibrator.observe([0.9, 0.8, 0.7, 0.6], verified_depth=0, accepted=0)  # nothing verified
    assert calibrator.sample_counts == (2, 2, 1, 0)
    with pytest.raises(ValueError):
        calibrator.observe([0.9, 0.8], verified_depth=1, accepted=2)
    with pytest.raises(ValueError):
        calibrator.observe([0.9, 0.8], verified_depth=3, accepted=0)  # deeper than proposals
    with pytest.raises(ValueError):
        ConfidenceCalibrator(positions=2).observe([0.9] * 3, verified_depth=3, accepted=0)  # deeper than positions


def feed_windows(calibrator, rng, true_temperatures, windows):
    """Drafts survive in sequence, each with its calibrated chance, until the first failure."""
    positions = len(true_temperatures)
    for _ in range(windows):
        raw = sigmoid(rng.normal(1.5, 1.5, positions))
        truth = sigmoid(np.array([logit(c) for c in raw]) / true_temperatures)
        survived = rng.random(positions) < truth
        accepted = positions if survived.all() else int(np.argmin(survived))
        calibrator.observe(list(raw), verified_depth=positions, accepted=accepted)


def test_calibrator_recovers_per_position_temperatures():
    # Deep positions are only observed after every earlier draft survived (about 40% of
    # windows reach position 4 here), exactly as in serving. Over seeds the fits spread by
    # about 2% at position 1 and 5% at position 4 (3000 samples at T = 2.5); we allow 12%.
    rng = np.random.default_rng(11)
    true_temperatures = np.array([0.7, 1.0, 1.5, 2.5])
    calibrator = ConfidenceCalibrator(positions=4, window=6000, min_samples=64, refit_every=200)
    feed_windows(calibrator, rng, true_temperatures, 8000)
    assert all(count >= 1500 for count in calibrator.sample_counts)
    assert calibrator.temperatures == pytest.approx(true_temperatures, rel=0.12)
    raw = [0.9, 0.9, 0.9, 0.9]
    expected = [float(sigmoid(logit(0.9) / t)) for t in calibrator.temperatures]
    assert calibrator.calibrate(raw) == pytest.approx(expected)
    assert calibrator.calibrate(raw + [0.9]) == pytest.approx(expected + [0.9])  # beyond positions: raw


def test_calibrator_fits_first_at_min_samples_then_every_refit_every():
    calibrator = ConfidenceCalibrator(positions=1, window=100, min_samples=10, refit_every=5)
    # Confident raw 0.95 that fails half the time: the fit flattens it to 1/2 (T at its bound).
    for outcome in [1, 0] * 4 + [1]:
        calibrator.observe([0.95], verified_depth=1, accepted=outcome)
    assert calibrator.temperatures == (1.0,)  # 9 samples: not yet
    calibrator.observe([0.95], verified_depth=1, accepted=0)
    first = calibrator.temperatures[0]
    assert first == MAX_TEMPERATURE
    for _ in range(4):  # successes now, but only 4 new samples: no refit yet
        calibrator.observe([0.95], verified_depth=1, accepted=1)
    assert calibrator.temperatures[0] == first
    calibrator.observe([0.95], verified_depth=1, accepted=1)  # 5th: refit on 10 ones of 15
    assert calibrator.temperatures[0] < first


def test_calibrator_window_bounds_memory_and_follows_drift():
    rng = np.random.default_rng(5)
    calibrator = ConfidenceCalibrator(positions=1, window=3000, min_samples=64, refit_every=100)
    feed_windows(calibrator, rng, np.array([0.6]), 6000)
    assert calibrator.temperatures[0] == pytest.approx(0.6, rel=0.12)
    feed_windows(calibrator, rng, np.array([2.0]), 6000)
    assert calibrator.sample_counts == (3000,)
    assert calibrator.temperatures[0] == pytest.approx(2.0, rel=0.12)


def test_calibrator_refuses_impossible_settings():
    with pytest.raises(ValueError):
        ConfidenceCalibrator(positions=0)
    with pytest.raises(ValueError):
        ConfidenceCalibrator(positions=2, window=10, min_samples=20)

"""Online calibration of the drafter's confidence head (sequential temperature scaling).

The head's c_k is meant to be the chance that draft k survives given that drafts
1..k-1 did; raw heads are off by several points, and pricing multiplies them, so the
errors compound. Per position k we fit one temperature T_k to observed verify outcomes
and use sigmoid(logit(c_k) / T_k) instead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

# Probabilities are clipped this far from 0 and 1 so their logits stay finite.
PROBABILITY_CLIP = 1e-6
# Temperatures are searched within these bounds: beyond them a head is either
# ignored (T large: everything near 1/2) or trusted to extremes (T small).
MIN_TEMPERATURE = 0.05
MAX_TEMPERATURE = 20.0


def logit(probability: float) -> float:
    """log(p / (1 - p)), with p clipped away from 0 and 1."""
    p = min(max(probability, PROBABILITY_CLIP), 1.0 - PROBABILITY_CLIP)
    return math.log(p / (1.0 - p))


def sigmoid(x: np.ndarray | float) -> np.ndarray | float:
    """1 / (1 + exp(-x)), written with tanh so large |x| does not overflow."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=float)))


def fit_temperature(
    logits: Sequence[float],
    outcomes: Sequence[int],
    min_temperature: float = MIN_TEMPERATURE,
    max_temperature: float = MAX_TEMPERATURE,
) -> float:
    """The T in [min_temperature, max_temperature] minimising the binary cross-entropy of
    sigmoid(logits / T) against 0/1 outcomes.

    With b = 1/T the loss sum(softplus(b z) - y b z) is convex in b, so its slope
    sum(z (sigmoid(b z) - y)) rises with b: bisecting the slope's sign (in log b) finds
    the minimum without step sizes to tune. A minimum outside the bounds (e.g. logits
    that anti-correlate with outcomes) lands on the nearest bound. Logits that carry no
    information (all zero) give T = 1.
    """
    z = np.asarray(logits, dtype=float)
    y = np.asarray(outcomes, dtype=float)
    if z.shape != y.shape or z.ndim != 1 or z.size == 0:
        raise ValueError(f"need equal, non-empty 1-D logits and outcomes, got {z.shape} and {y.shape}")
    if not np.all(np.isfinite(z)):
        raise ValueError("logits must be finite")
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ValueError("outcomes must be 0 or 1")
    if not 0.0 < min_temperature <= max_temperature:
        raise ValueError(f"bad temperature bounds [{min_temperature}, {max_temperature}]")

    def slope(log_b: float) -> float:
        return float(np.dot(z, sigmoid(math.exp(log_b) * z) - y))

    low, high = -math.log(max_temperature), -math.log(min_temperature)
    slope_low, slope_high = slope(low), slope(high)
    if slope_low >= 0.0 and slope_high <= 0.0:
        return 1.0  # the loss is flat in T
    if slope_low >= 0.0:
        return max_temperature
    if slope_high <= 0.0:
        return min_temperature
    for _ in range(50):
        middle = 0.5 * (low + high)
        if slope(middle) < 0.0:
            low = middle
        else:
            high = middle
    return math.exp(-0.5 * (low + high))


class ConfidenceCalibrator:
    """Per-position temperatures fitted online to verify outcomes.

    Each position keeps a window of its most recent (logit of raw confidence, outcome)
    samples and refits its temperature when it first has `min_samples` samples and then
    after every `refit_every` new ones. A position without a fit passes the raw
    confidence through unchanged.
    """

    def __init__(self, positions: int, window: int = 2048, min_samples: int = 64, refit_every: int = 128) -> None:
        """`positions` is the most drafts a window can hold (the drafter's block size)."""
        if positions < 1 or window < 1 or min_samples < 1 or refit_every < 1:
            raise ValueError("positions, window, min_samples and refit_every must be positive")
        if min_samples > window:
            raise ValueError(f"min_samples {min_samples} can never be reached with window {window}")
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._samples: list[deque[tuple[float, int]]] = [deque(maxlen=window) for _ in range(positions)]
        self._unfitted_samples = [0] * positions
        self._temperatures: list[float | None] = [None] * positions

    def observe(self, raw_confidences: Sequence[float], verified_depth: int, accepted: int) -> None:
        """Record one window's outcome: drafts 1..accepted survived; draft accepted+1 failed
        if it was verified; later drafts were not observed (their condition did not hold)."""
        if not 0 <= accepted <= verified_depth <= min(len(raw_confidences), len(self._samples)):
            raise ValueError(
                f"need 0 <= accepted ({accepted}) <= verified_depth ({verified_depth}) <= "
                f"proposals ({len(raw_confidences)}) and positions ({len(self._samples)})"
            )
        outcomes = [1] * accepted + ([0] if accepted < verified_depth else [])
        for position, outcome in enumerate(outcomes):
            self._samples[position].append((logit(raw_confidences[position]), outcome))
            self._unfitted_samples[position] += 1
            if self._refit_due(position):
                self._refit(position)

    def calibrate(self, raw_confidences: Sequence[float]) -> list[float]:
        """Calibrated confidences: sigmoid(logit(c_k) / T_k), or c_k where T_k is not fitted."""
        calibrated = []
        for position, raw in enumerate(raw_confidences):
            temperature = self._temperatures[position] if position < len(self._temperatures) else None
            calibrated.append(raw if temperature is None else float(sigmoid(logit(raw) / temperature)))
        return calibrated

    @property
    def temperatures(self) -> tuple[float, ...]:
        """The temperature in use per position (1.0, the identity, where none is fitted)."""
        return tuple(1.0 if t is None else t for t in self._temperatures)

    @property
    def sample_counts(self) -> tuple[int, ...]:
        """Samples currently in each position's window."""
        return tuple(len(samples) for samples in self._samples)

    def _refit_due(self, position: int) -> bool:
        if len(self._samples[position]) < self._min_samples:
            return False
        first_fit = self._temperatures[position] is None
        return first_fit or self._unfitted_samples[position] >= self._refit_every

    def _refit(self, position: int) -> None:
        logits, outcomes = zip(*self._samples[position])
        self._temperatures[position] = fit_temperature(logits, outcomes)
        self._unfitted_samples[position] = 0

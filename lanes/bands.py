"""Bands: the coarse (lanes, context) buckets that costs and guard verdicts are kept in.

A round's cost and whether drafting pays both move with how many lanes share the round
and how long their contexts are; bucketing by powers of two keeps the number of buckets
small enough that each one collects real measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Lanes bands: 1, 2-3, 4-7, 8-15, 16+ (each named by its smallest lane count).
LANES_BAND_FLOORS = (1, 2, 4, 8, 16)
# Context bands: up to 2K, 4K, ..., 128K tokens (each named by its largest context;
# the top band also holds anything longer).
CONTEXT_BAND_CEILINGS = tuple(2048 << i for i in range(7))


def lanes_band(lanes: int) -> int:
    """The floor of the lanes band that `lanes` (>= 1) falls in: 1, 2, 4, 8 or 16."""
    if lanes < 1:
        raise ValueError(f"a round has at least one lane, got {lanes}")
    return max(floor for floor in LANES_BAND_FLOORS if floor <= lanes)


def context_band(context_tokens: int) -> int:
    """The ceiling of the context band that `context_tokens` (>= 0) falls in: 2048 .. 131072."""
    if context_tokens < 0:
        raise ValueError(f"context length cannot be negative, got {context_tokens}")
    for ceiling in CONTEXT_BAND_CEILINGS:
        if context_tokens <= ceiling:
            return ceiling
    return CONTEXT_BAND_CEILINGS[-1]


@dataclass(frozen=True, order=True)
class Band:
    """One (lanes band, context band) bucket, named by its lanes floor and context ceiling."""

    lanes: int
    context: int

    @classmethod
    def of(cls, lanes: int, context_tokens: int) -> Band:
        """The band of a round with `lanes` lanes at `context_tokens` tokens of context."""
        return cls(lanes_band(lanes), context_band(context_tokens))

    @property
    def lanes_label(self) -> str:
        """'1', '2-3', '4-7', '8-15' or '16+'."""
        if self.lanes == LANES_BAND_FLOORS[-1]:
            return f"{self.lanes}+"
        upper = 2 * self.lanes - 1
        return str(self.lanes) if upper == self.lanes else f"{self.lanes}-{upper}"

    @property
    def context_label(self) -> str:
        """'2K' .. '128K': the band's largest context."""
        return f"{self.context // 1024}K"

    def distance(self, other: Band) -> float:
        """How many band steps apart two bands are (lanes steps plus context steps)."""
        return abs(math.log2(self.lanes / other.lanes)) + abs(math.log2(self.context / other.context))

    def __str__(self) -> str:
        return f"lanes={self.lanes_label},context<={self.context_label}"

"""Running totals of what rounds did, for the daemon's metrics and for benchmarks.

Plain Python numbers only: the daemon reads `snapshot()` from its own thread.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

# Upper bounds (seconds) of the round-time histogram: a plain step is milliseconds on a
# GPU, tens of milliseconds on a CPU; a round past seconds is a fault or a long prefill.
ROUND_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


class RoundCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self.rounds_by_kind: Counter[str] = Counter()
        # Rounds, their seconds and their emitted tokens, of rounds that drafted (lookups
        # included) and of plain ones: what drafting cost or gained against the same
        # engine's plain rounds, and each mode's mean round.
        self.rounds_by_mode: Counter[str] = Counter()
        self.seconds_by_mode: Counter[str] = Counter()
        self.emitted_by_mode: Counter[str] = Counter()
        self.guard_reasons: Counter[str] = Counter()
        self.rows_histogram: Counter[int] = Counter()  # verify rows per round
        self.seconds_histogram = [0] * (len(ROUND_SECONDS_BUCKETS) + 1)  # per bucket, the last for +Inf
        self.emitted = 0
        self.round_seconds = 0.0
        self.draft_seconds = 0.0
        self.looked_up_windows = 0  # lane-rounds that verified drafts copied by prompt lookup
        self.last_round_seconds = 0.0
        self.proposed_at: list[int] = []  # verified drafts by position (1-based index k-1)
        self.accepted_at: list[int] = []

    def record(self, report) -> None:
        """Fold in one round's RoundReport."""
        with self._lock:
            self.rounds_by_kind[report.kind] += 1
            mode = "drafted" if report.drafting_lanes else "plain"
            self.rounds_by_mode[mode] += 1
            self.seconds_by_mode[mode] += report.seconds
            self.emitted_by_mode[mode] += report.emitted
            if report.decision is not None:
                self.guard_reasons[report.decision.reason] += 1
            self.rows_histogram[report.rows] += 1
            self.seconds_histogram[bisect.bisect_left(ROUND_SECONDS_BUCKETS, report.seconds)] += 1
            self.emitted += report.emitted
            self.round_seconds += report.seconds
            self.last_round_seconds = report.seconds
            self.draft_seconds += report.draft_seconds
            self.looked_up_windows += report.looked_up_lanes
            for k, (proposed, accepted) in enumerate(zip(report.proposed_per_position, report.accepted_per_position)):
                if k == len(self.proposed_at):
                    self.proposed_at.append(0)
                    self.accepted_at.append(0)
                self.proposed_at[k] += proposed
                self.accepted_at[k] += accepted

    def snapshot(self) -> dict:
        with self._lock:
            cumulative, buckets = 0, []
            for bound, count in zip(ROUND_SECONDS_BUCKETS, self.seconds_histogram):
                cumulative += count
                buckets.append([bound, cumulative])
            return {
                "rounds_by_kind": dict(self.rounds_by_kind),
                "rounds_by_mode": dict(self.rounds_by_mode),
                "seconds_by_mode": dict(self.seconds_by_mode),
                "emitted_by_mode": dict(self.emitted_by_mode),
                "guard_reasons": dict(self.guard_reasons),
                "verify_rows": dict(self.rows_histogram),
                "round_seconds": {"buckets": buckets, "sum": self.round_seconds, "count": sum(self.seconds_histogram)},
                "last_round_seconds": self.last_round_seconds,
                "emitted_tokens": self.emitted,
                "draft_seconds": self.draft_seconds,
                # Lane-rounds that verified at least one draft: those that verified a first.
                "drafts_total": self.proposed_at[0] if self.proposed_at else 0,
                "looked_up_drafts_total": self.looked_up_windows,
                "draft_tokens_total": sum(self.proposed_at),
                "accepted_tokens_total": sum(self.accepted_at),
                "proposed_per_position": list(self.proposed_at),
                "accepted_per_position": list(self.accepted_at),
            }

"""Running totals of what rounds did, for the daemon's metrics and for benchmarks.

Plain Python numbers only: the daemon reads `snapshot()` from its own thread.
"""

from __future__ import annotations

import threading
from collections import Counter



class RoundCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self.rounds_by_kind: Counter[str] = Counter()
        self.guard_reasons: Counter[str] = Counter()
        self.rows_histogram: Counter[int] = Counter()  # verify rows per round
        self.emitted = 0
        self.round_seconds = 0.0
        self.draft_seconds = 0.0
        self.proposed_at: list[int] = []  # verified drafts by position (1-based index k-1)
        self.accepted_at: list[int] = []

    def record(self, report) -> None:
        """Fold in one round's RoundReport."""
        with self._lock:
            self.rounds_by_kind[report.kind] += 1
            if report.decision is not None:
                self.guard_reasons[report.decision.reason] += 1
            self.rows_histogram[report.rows] += 1
            self.emitted += report.emitted
            self.round_seconds += report.seconds
            self.draft_seconds += report.draft_seconds
            for k, (proposed, accepted) in enumerate(zip(report.proposed_per_position, report.accepted_per_position)):
                if k == len(self.proposed_at):
                    self.proposed_at.append(0)
                    self.accepted_at.append(0)
                self.proposed_at[k] += proposed
                self.accepted_at[k] += accepted

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "rounds_by_kind": dict(self.rounds_by_kind),
                "guard_reasons": dict(self.guard_reasons),
                "verify_rows": dict(self.rows_histogram),
                "emitted_tokens": self.emitted,
                "round_seconds": self.round_seconds,
                "draft_seconds": self.draft_seconds,
                "proposed_per_position": list(self.proposed_at),
                "accepted_per_position": list(self.accepted_at),
            }

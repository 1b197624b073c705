"""Stop strings matched across token boundaries over incrementally decoded text."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Streams text through, holding back any tail that could be the start of a stop
    string, and cuts the text before the first stop string to be completed.

    "First completed" (earliest end; on a tie the longer, earlier-starting one) is what
    generation would see reading the text one character at a time, so the result does not
    depend on how the text was split into deltas. Empty stop strings are ignored (they
    would match before any text).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(sorted({stop for stop in stops if stop}))
        self._held = ""
        self._stopped = False

    @property
    def watching(self) -> bool:
        """Whether there is any stop string to match."""
        return bool(self._stops)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been hit."""
        return self._stopped

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Take newly decoded text; return (text safe to emit now, whether a stop string
        was hit). On a hit the text before the stop string is returned and everything from
        it on is dropped; once stopped, every later call returns ("", True)."""
        if self._stopped:
            return "", True
        text = self._held + text_delta
        # (end, start) of each stop's first occurrence: the earliest end was completed first.
        hits = [(start + len(stop), start) for stop in self._stops if (start := text.find(stop)) >= 0]
        if hits:
            _, start = min(hits)
            self._held = ""
            self._stopped = True
            return text[:start], True
        # No stop string lies fully inside `text`, so a stop string can only begin in the
        # tail that is itself the start of one; everything before that tail is safe.
        held = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - held :]
        return text[: len(text) - held], False

    def flush(self) -> str:
        """At the end of the stream: the held-back text (none once stopped)."""
        held, self._held = self._held, ""
        return held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        longest = max((len(stop) - 1 for stop in self._stops), default=0)
        for length in range(min(longest, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

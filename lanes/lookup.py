"""Prompt lookup beside the drafter: proposals copied from the lane's own tokens.

Where a lane's last n tokens occurred before in its prompt or reply, what followed them
then is a proposal that costs no drafter forward: quoted passages, code, lists and the
loops of greedy decoding repeat. A round takes such a proposal for a lane when it is
worth more than the drafter's, judged like any window: expected tokens per second.

`NgramIndex` finds the latest earlier occurrence of the longest suffix (n = max_ngram
down to a minimum) in O(1) per round, extended with each lane's committed tokens as they
come. The round's `CountedChances` (lanes/pricing.py) learn, per match length n and
draft position k, how often a looked-up draft survives verification given that the ones
before it did; their chain chances price lookup windows as calibrated confidences price
the drafter's.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3


def check_min_ngram(n: int) -> None:
    """Refuse a shortest match outside 0..MAX_NGRAM (0: no lookup), naming the flag."""
    if not 0 <= n <= MAX_NGRAM:
        raise ValueError(f"--prompt-lookup must be within 0..{MAX_NGRAM} (the shortest match to copy from; 0 turns it off), got {n}")


class NgramIndex:
    """Where each n-gram (n = 1..max_ngram) of one lane's tokens last occurred, for
    copying what followed it. Append-only, like the lane's committed tokens."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n -> n-gram -> the index of the token that followed its latest occurrence
        self._followed: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(1, max_ngram + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows the n-grams ending just before it
            for n in range(1, min(self.max_ngram, end) + 1):
                self._followed[n][tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, width: int, min_ngram: int = 1) -> tuple[list[int], int]:
        """`width` tokens copied from after the latest earlier occurrence of the longest
        suffix of at least `min_ngram` tokens, and that suffix's length n ([] and 0 when
        none occurred before). A copy that reaches the end of the tokens goes on through
        what it copied, so a loop of period p proposes the whole width, not p tokens."""
        for n in range(min(self.max_ngram, len(self.tokens)), max(min_ngram, 1) - 1, -1):
            start = self._followed[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                copied = self.tokens[start : start + width]
                while len(copied) < width:  # tokens[start + i] of the sequence the copy extends
                    copied.append(copied[start + len(copied) - len(self.tokens)])
                return copied, n
        return [], 0

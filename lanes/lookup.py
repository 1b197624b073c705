"""Prompt lookup beside the drafter: proposals copied from the lane's own tokens.

Where a lane's last n tokens occurred before in its prompt or reply, what followed them
then is a proposal that costs no drafter forward: quoted passages, code, lists and the
loops of greedy decoding repeat. A round takes such a proposal for a lane when it is
worth more than the drafter's, judged like any window: expected tokens per second.

`NgramIndex` finds the latest earlier occurrence of the longest suffix (n = max_ngram
down to a minimum) in O(1) per round, extended with each lane's committed tokens as they
come. `LookupChances` learns, per match length n and draft position k, how often a
looked-up draft survives verification given that the ones before it did; its chain
chances price lookup windows as calibrated confidences price the drafter's.
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


# The prior of LookupChances, as survived and failed pseudo-counts: optimistic (0.75), so
# lookup gets tried against a drafter of good yield and its chances are then learned.
PRIOR_SURVIVED, PRIOR_FAILED = 3, 1


class LookupChances:
    """Survival of looked-up drafts by (match length n, position k), counted from verify
    outcomes over a prior: c_nk = (survived + 3) / (verified + 4)."""

    def __init__(self, max_ngram: int, positions: int):
        self._survived = [[0] * positions for _ in range(max_ngram + 1)]
        self._verified = [[0] * positions for _ in range(max_ngram + 1)]

    def confidences(self, n: int, depth: int) -> list[float]:
        """c_n1..c_n,depth: the chance draft k survives given that drafts 1..k-1 did."""
        prior = PRIOR_SURVIVED + PRIOR_FAILED
        return [(s + PRIOR_SURVIVED) / (v + prior) for s, v in zip(self._survived[n][:depth], self._verified[n][:depth])]

    def observe(self, n: int, verified_depth: int, accepted: int) -> None:
        """Drafts 1..accepted survived; draft accepted+1 failed if it was verified."""
        if not 0 <= accepted <= verified_depth <= len(self._verified[n]):
            raise ValueError(f"need 0 <= accepted ({accepted}) <= verified_depth ({verified_depth}) <= {len(self._verified[n])}")
        for k in range(min(accepted + 1, verified_depth)):
            self._verified[n][k] += 1
            self._survived[n][k] += k < accepted

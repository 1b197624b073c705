"""Incremental detokenization for byte-level BPE.

One UTF-8 character can be split across tokens, and a token's text can depend on its
neighbours, so text is produced by decoding a short window of recent tokens and
emitting what it adds beyond the window's already-emitted part. A window that ends in
an incomplete character (decoded as U+FFFD) is held back until the next token
completes it.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # first token of the decode window
        self._emitted = 0  # tokens whose text has been emitted

    def add(self, token_ids: list[int]) -> str:
        """New text made safe by these tokens."""
        self._ids += token_ids
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._emitted == len(self._ids):
            return ""
        shown = self._decode(self._ids[self._start : self._emitted])
        text = self._decode(self._ids[self._start :])
        if text.endswith(REPLACEMENT) and not final:
            return ""
        self._start, self._emitted = self._emitted, len(self._ids)
        return text[len(shown) :]

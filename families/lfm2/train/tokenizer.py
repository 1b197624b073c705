"""Training the byte-level BPE tokenizer on the corpus's train part.

The tokenizer is LFM2's format (bpe.py): special tokens at LFM2's ids, `<|mask|>` for
the drafter, ChatML chat template. Chat examples are left out of its training text:
their only special strings are the template's, which are added tokens and never merged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from ..bpe import save_tokenizer, train_bpe
from .corpus import documents, pieces

DEFAULT_VOCAB = 4096


def training_texts(corpus: str | Path, max_chars: int | None) -> Iterator[str]:
    """Plain train documents in paragraph-sized pieces, up to `max_chars` in all."""
    seen = 0
    for doc in documents(corpus, "train"):
        if doc.source.endswith("/chat"):
            continue
        for piece in pieces(doc.text):
            if max_chars is not None and seen >= max_chars:
                return
            seen += len(piece)
            yield piece


def train_tokenizer(corpus: str | Path, out: str | Path, vocab_size: int = DEFAULT_VOCAB, max_chars: int | None = None, log=print) -> Path:
    """Train on the train part (or its first `max_chars` characters) and save
    tokenizer.json + tokenizer_config.json under `out`."""
    started = time.perf_counter()
    tokenizer = train_bpe(training_texts(corpus, max_chars), vocab_size)
    save_tokenizer(tokenizer, out)
    log(f"tokenizer: {tokenizer.get_vocab_size(with_added_tokens=True)} entries -> {out} ({time.perf_counter() - started:.1f} s)")
    return Path(out)

"""The training corpus: sources read from xz files, split into train and held-out parts,
turned into documents, and tokenized into flat token arrays.

Every source file is split once, deterministically: the last `EVAL_FRACTION` of its
text (cut at the next document or paragraph boundary) is held out for evaluation, the
rest is for training. Documents come from each part separately, so nothing of the
held-out text leaks into training, not even through the chat examples.

Documents are the plain text (one per fortune, one per source part otherwise) plus chat
examples built from entries that read naturally as replies: a fortune answers "Tell me
something.", a Devil's Dictionary definition answers "Define X.", a Jargon File entry
answers "What is X?". They are written in the chat template's exact text, so a model
trained on them answers `--chat` prompts and ends its reply with `<|im_end|>`.

A tokenized document is `<|startoftext|> ids <|endoftext|>`: the start token matches
what serving puts before every prompt, the end token separates documents.
"""

from __future__ import annotations

import json
import lzma
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ..bpe import BOS, EOS_TEXT

EVAL_FRACTION = 0.02
FORTUNE_SEPARATOR = "\n%\n"
# Long documents are encoded in pieces of about this many characters, so that
# encode_batch spreads one big source over every core.
PIECE_CHARS = 1 << 16
PARTS = ("train", "eval")

FORTUNE_PROMPTS = ("Tell me something.", "Tell me a fortune.", "Say something wise.", "Tell me a joke.")
# "ABASEMENT, n.  A decent and customary ..." (the headword, its part of speech, the text)
DEVIL_ENTRY = re.compile(r"([A-Z][A-Z' -]*[A-Z]), ([a-z][a-z.]*\.)\s+(.+)", re.DOTALL)
# "   :/dev/null: /dev·nuhl/, n." then a blank line and the entry's first paragraph.
JARGON_ENTRY = re.compile(r"^   :([^:\n]+):[^\n]*\n\n((?:   \S[^\n]*\n)+)", re.MULTILINE)


@dataclass(frozen=True)
class Document:
    source: str
    text: str


def chat_text(user: str, assistant: str) -> str:
    """One exchange exactly as the chat template renders it (the start token is added
    at tokenization, as for every document)."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


def collapse(text: str) -> str:
    """Hard-wrapped prose as one line: replies read as sentences, not as the source's layout."""
    return " ".join(text.split())


def read_source(path: Path) -> str:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def source_names(corpus: Path) -> list[str]:
    names = sorted(p.name.removesuffix(".txt.xz") for p in corpus.glob("*.txt.xz"))
    if not names:
        raise FileNotFoundError(f"no *.txt.xz sources in {corpus}")
    return names


def split_source(text: str, separator: str, fraction: float = EVAL_FRACTION) -> tuple[str, str]:
    """(train, eval): the eval part starts at the first `separator` after the cut point,
    so no document or paragraph is shared by both."""
    cut = text.find(separator, int(len(text) * (1 - fraction)))
    if cut < 0:
        cut = int(len(text) * (1 - fraction))
    else:
        cut += len(separator)
    return text[:cut], text[cut:]


def fortunes(text: str) -> list[str]:
    return [f.strip("\n") for f in ("\n" + text + "\n").split(FORTUNE_SEPARATOR) if f.strip()]


def devil_entries(text: str) -> list[tuple[str, str]]:
    """(headword, definition) for each dictionary entry: its first paragraph, which is
    the definition proper (illustrative verse follows in later paragraphs)."""
    entries = []
    for paragraph in text.split("\n\n"):
        m = DEVIL_ENTRY.fullmatch(paragraph.strip())
        if m:
            entries.append((m[1].capitalize(), collapse(f"{m[1].capitalize()}, {m[2]} {m[3]}")))
    return entries


def jargon_entries(text: str) -> list[tuple[str, str]]:
    return [(m[1].strip(), collapse(m[2])) for m in JARGON_ENTRY.finditer(text)]


def chat_examples(source: str, text: str) -> list[str]:
    if source == "fortunes":
        return [chat_text(FORTUNE_PROMPTS[i % len(FORTUNE_PROMPTS)], f) for i, f in enumerate(fortunes(text))]
    if source == "devils-dictionary":
        return [chat_text(f"Define {word.lower()}.", definition) for word, definition in devil_entries(text)]
    if source == "jargon":
        return [chat_text(f"What is {term}?", entry) for term, entry in jargon_entries(text)]
    return []


def source_documents(source: str, text: str) -> list[Document]:
    """The plain documents of one source part, then its chat examples."""
    plain = fortunes(text) if source == "fortunes" else [text.strip("\n")]
    return [Document(source, t) for t in plain if t] + [Document(source + "/chat", t) for t in chat_examples(source, text)]


def documents(corpus: str | Path, part: str) -> Iterator[Document]:
    """Every document of the `part` ("train" or "eval") of every source, in a fixed order."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    corpus = Path(corpus)
    for name in source_names(corpus):
        separator = FORTUNE_SEPARATOR if name == "fortunes" else "\n\n"
        train, held_out = split_source(read_source(corpus / f"{name}.txt.xz"), separator)
        yield from source_documents(name, train if part == "train" else held_out)


def pieces(text: str) -> list[str]:
    """A long text cut after paragraph breaks into pieces of about PIECE_CHARS. Encoding
    pieces instead of the whole changes at most the whitespace token at a cut."""
    out, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = text.find("\n\n", start + PIECE_CHARS)
        if cut < 0:
            break
        out.append(text[start : cut + 2])
        start = cut + 2
    out.append(text[start:])
    return out


def encode_documents(tokenizer: Tokenizer, docs: list[Document]) -> np.ndarray:
    """`<|startoftext|> ids <|endoftext|>` for every document, concatenated."""
    texts, owner = [], []
    for i, doc in enumerate(docs):
        for piece in pieces(doc.text):
            texts.append(piece)
            owner.append(i)
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)  # all cores
    out: list[np.ndarray] = []
    for i, enc in enumerate(encoded):
        if i == 0 or owner[i] != owner[i - 1]:
            if out:
                out.append(np.array([EOS_TEXT]))
            out.append(np.array([BOS]))
        out.append(np.asarray(enc.ids))
    out.append(np.array([EOS_TEXT]))
    return np.concatenate(out)


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def tokenize_corpus(corpus: str | Path, tokenizer_dir: str | Path, out: str | Path, log=print) -> dict:
    """Write `train.npy` and `eval.npy` (flat token arrays) and `corpus.json` (counts per
    source) under `out`; returns the counts."""
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"tokenizer": str(tokenizer_dir), "parts": {}}
    for part in PARTS:
        started = time.perf_counter()
        by_source: dict[str, list[Document]] = {}
        for doc in documents(corpus, part):
            by_source.setdefault(doc.source, []).append(doc)
        arrays, counts = [], {}
        for source, docs in by_source.items():
            ids = encode_documents(tokenizer, docs)
            chars = sum(len(d.text) for d in docs)
            counts[source] = {"documents": len(docs), "chars": chars, "tokens": int(ids.size)}
            arrays.append(ids.astype(dtype))
            log(f"{part:5s} {source:28s} {len(docs):7d} docs {chars / 1e6:8.2f} M chars {ids.size / 1e6:7.2f} M tokens ({chars / max(ids.size, 1):.2f} chars/token)")
        tokens = np.concatenate(arrays)
        np.save(out / f"{part}.npy", tokens)
        summary["parts"][part] = {"tokens": int(tokens.size), "sources": counts}
        log(f"{part}: {tokens.size / 1e6:.2f} M tokens -> {out / f'{part}.npy'} ({tokens.nbytes / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s)")
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary

"""Regenerating training text with the trained target, for its drafter.

A drafter proposes what the target will say next, so it learns best from text the
target itself wrote: prompts are windows of the corpus (train prompts for the train
set, held-out prompts for the eval set), a share of them ending just after a chat
example's `<|im_start|>assistant\n` so that chat replies are among what it learns, and
the target continues each one, greedily or by sampling at a temperature (batches
alternate over `--temperatures`, so the drafter sees both the loops of greedy decoding
and the spread of sampling). With `--repetition-penalty` (and `--min-p`) it writes as a
checkpoint's sampling defaults would: text a drafter meets when serving at them, which
unpenalised text is not. The drafter trainer then anchors its blocks only in the
generated part of each row, with the prompt as context.

The other prompts lie anywhere in the part, so each source gets prompts in proportion
to its tokens (the kernel documentation is 61% of the corpus), or with
`--even-sources` evenly over the plain sources that corpus.json lists, as a user's
prompts might be.

Decoding runs through the serving target (`Lfm2Target`: slot caches, one forward per
step for every row of a batch), so the text is exactly what serving would produce.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from ..loader import load_model
from ..target import Lfm2Target
from .corpus import token_dtype
from .loop import Budget, load_tokens, log, random_windows

META = "generated.json"


ASSISTANT_HEADER = "<|im_start|>assistant\n"
START, END = "<|startoftext|>", "<|endoftext|>"
# The fewest tokens of a paragraph a served prompt opens with.
MIN_OPENING = 4


def reply_starts(tokens: np.ndarray, header: list[int]) -> np.ndarray:
    """Every position just after an assistant header in the token array."""
    starts = np.flatnonzero(tokens[: tokens.size - len(header)] == header[0])
    match = np.all([tokens[starts + j] == h for j, h in enumerate(header)], axis=0)
    return starts[match] + len(header)


def source_spans(data: str | Path, part: str, length: int) -> list[tuple[int, int]]:
    """[start, end) of each plain (not chat) source in a part's flat array, from the
    corpus step's corpus.json (sources in array order), each long enough for a window."""
    sources = json.loads((Path(data) / "corpus.json").read_text())["parts"][part]["sources"]
    bounds = np.cumsum([0] + [s["tokens"] for s in sources.values()])
    return [(int(a), int(b)) for name, a, b in zip(sources, bounds[:-1], bounds[1:]) if not name.endswith("/chat") and b - a > length]


class Prompts:
    """Prompts of one part, at most `length` tokens each. A `served_share` of them are cut
    as a user sends them (`served`); of the rest, a `chat_share` are the `length` tokens
    before a chat reply begins, the others windows anywhere, or in `spans` (one drawn
    uniformly per window)."""

    def __init__(self, tokens: np.ndarray, header: list[int], length: int, chat_share: float,
                 spans: list[tuple[int, int]] | None = None, served_share: float = 0.0,
                 start: int | None = None, ends: tuple[int, ...] = (), line_ends: np.ndarray | None = None):
        """`start`: the token that opens every document (and every prompt serving reads);
        `ends`: ids that close a document; `line_ends[id]`: how many line breaks the id's
        text ends with (0-2; see `document_marks`). Served prompts need all three."""
        if served_share and (start is None or line_ends is None):
            raise ValueError(f"served prompts need the tokenizer's {START} and its ids' text")
        self.tokens, self.length, self.chat_share, self.served_share = tokens, length, chat_share, served_share
        self.start = start
        replies = reply_starts(tokens, header)
        self.reply_starts = replies[replies >= length]
        self.spans = spans or [(0, tokens.size)]
        if served_share:
            self._find_served(replies, header[0], ends, line_ends)

    def _find_served(self, replies: np.ndarray, turn: int, ends: tuple[int, ...], line_ends: np.ndarray) -> None:
        """`chats`: [start, end) of each chat example up to its reply, where it fits in
        `length`; `openings`, per span: the positions where a paragraph opens (after a
        start token or a blank line, not a chat turn's `turn` token) with at least
        MIN_OPENING tokens of its document after them; `room`: how many tokens of its
        document follow each position."""
        starts = np.flatnonzero(self.tokens == self.start)
        before = np.searchsorted(starts, replies, side="right") - 1  # each reply's example opens there
        own = starts[np.maximum(before, 0)] if starts.size else replies
        fits = (before >= 0) & (replies - own <= self.length)
        self.chats = np.stack([own[fits], replies[fits]], axis=1) if fits.any() else np.zeros((0, 2), np.int64)
        positions = np.arange(self.tokens.size)
        closes = np.append(np.flatnonzero(np.isin(self.tokens, [self.start, *ends])), self.tokens.size)
        self.room = closes[np.searchsorted(closes, positions)] - positions
        breaks = line_ends[self.tokens]
        opens = np.zeros(self.tokens.size, bool)
        opens[1:] = (self.tokens[:-1] == self.start) | (breaks[:-1] == 2)
        opens[2:] |= (breaks[1:-1] == 1) & (breaks[:-2] >= 1)  # a blank line in two tokens
        opens &= self.tokens != turn
        openings = [a + np.flatnonzero(opens[a:b] & (self.room[a:b] >= MIN_OPENING)) for a, b in self.spans]
        self.openings = [o for o in openings if o.size]

    def served(self, rng: np.random.Generator, count: int) -> list[np.ndarray]:
        """`count` prompts as a user sends them: a chat example from its start token to
        where its reply begins, or the start token and the first MIN_OPENING..length-1
        tokens of a paragraph (the document's, where it ends sooner)."""
        chats = rng.binomial(count, self.chat_share) if len(self.chats) else 0
        if count - chats and not self.openings:
            raise ValueError("no paragraph openings to cut served prompts from")
        prompts = [self.tokens[a:b] for a, b in self.chats[rng.integers(0, len(self.chats), size=chats)]]
        for _ in range(count - chats):
            opening = self.openings[rng.integers(len(self.openings))]
            at = int(opening[rng.integers(opening.size)])
            words = min(int(rng.integers(MIN_OPENING, self.length)), int(self.room[at]))
            prompts.append(np.concatenate([[self.start], self.tokens[at : at + words]]))
        return [p.astype(np.int32) for p in prompts]

    def draw(self, rng: np.random.Generator, count: int) -> list[np.ndarray]:
        served = rng.binomial(count, self.served_share) if self.served_share else 0
        count -= served
        chats = rng.binomial(count, self.chat_share) if self.reply_starts.size else 0
        ends = rng.choice(self.reply_starts, size=chats)
        chat = [self.tokens[e - self.length : e].astype(np.int32) for e in ends]
        per_span = np.bincount(rng.integers(0, len(self.spans), size=count - chats), minlength=len(self.spans))
        plain = [w for (a, b), n in zip(self.spans, per_span) if n for w in random_windows(self.tokens[a:b], rng, n, self.length)]
        return chat + plain + (self.served(rng, served) if served else [])


def document_marks(tokenizer: Tokenizer) -> dict:
    """What `Prompts` reads to cut served prompts: the start and end tokens' ids, and how
    many line breaks each id's text ends with (0-2, spaces after them ignored)."""
    def breaks(text: str) -> int:
        text = text.rstrip(" ")
        return min(2, len(text) - len(text.rstrip("\n")))

    line_ends = np.array([breaks(tokenizer.decode([i])) for i in range(tokenizer.get_vocab_size())], dtype=np.int8)
    end = tokenizer.token_to_id(END)
    return dict(start=tokenizer.token_to_id(START), ends=() if end is None else (end,), line_ends=line_ends)


@dataclass(frozen=True)
class Decoding:
    """How the target writes a batch: greedy at temperature 0, else sampled, after a
    CTRL repetition penalty over each row's tokens so far (1: none) and, when sampling,
    a min-p floor (0: none), in the order serving applies them."""

    temperature: float
    repetition_penalty: float = 1.0
    min_p: float = 0.0


def pick(logits: mx.array, seen: mx.array | None, decoding: Decoding) -> mx.array:
    """One token per row of `logits` [B, V]; `seen` [B, V] marks each row's tokens so far
    (None without a penalty)."""
    x = logits.astype(mx.float32)
    if seen is not None:
        p = decoding.repetition_penalty
        x = mx.where(seen, mx.where(x > 0, x / p, x * p), x)
    if decoding.temperature == 0:
        return mx.argmax(x, axis=-1)
    x = x / decoding.temperature
    if decoding.min_p > 0:
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        x = mx.where(logprobs >= logprobs.max(axis=-1, keepdims=True) + math.log(decoding.min_p), x, -mx.inf)
    return mx.random.categorical(x)


def continue_prompts(target: Lfm2Target, prompts: list[np.ndarray], length: int, decoding: Decoding) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt (at most `length` tokens) followed by the target's own tokens, `length`
    in all: the rows [B, length] and each row's prompt length [B]."""
    sizes = np.array([p.size for p in prompts])
    new_tokens = length - int(sizes.min())
    lanes = [target.open_lane() for _ in prompts]
    rows, seen = mx.arange(len(prompts)), None
    if decoding.repetition_penalty != 1.0:
        marked = np.zeros((len(prompts), target.vocab_size), dtype=bool)
        for i, prompt in enumerate(prompts):
            marked[i, prompt] = True
        seen = mx.array(marked)
    try:
        out = target.forward(lanes, [p.tolist() for p in prompts], logits="last")
        target.commit(out, sizes.tolist())
        produced = []
        for step in range(new_tokens):
            chosen = pick(out.logits, seen, decoding)
            if seen is not None:
                seen = seen.at[rows, chosen].maximum(mx.array(True))
            mx.eval(chosen, *([seen] if seen is not None else []), *target.state_arrays())
            produced.append(chosen.tolist())
            if step + 1 < new_tokens:
                out = target.forward(lanes, [[t] for t in produced[-1]], logits="last")
                target.commit(out, [1] * len(lanes))
    finally:
        for lane in lanes:
            target.close_lane(lane)
    continuations = np.array(produced, dtype=np.int64).T
    return np.stack([np.concatenate([p, c[: length - p.size]]) for p, c in zip(prompts, continuations)]), sizes


def generate_part(target: Lfm2Target, prompts: Prompts, rng: np.random.Generator, sequences: int, batch: int,
                  length: int, decodings: list[Decoding], budget: Budget, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Up to `sequences` rows of `length` tokens and their prompt lengths (fewer rows when
    the budget runs out, but at least one batch), batch after batch, the batches taking
    `decodings` in turn."""
    rows, sizes, started = [], [], time.perf_counter()
    while sum(len(r) for r in rows) < sequences and not (rows and budget.spent()):
        count = min(batch, sequences - sum(len(r) for r in rows))
        decoding = decodings[len(rows) % len(decodings)]
        batch_rows, batch_sizes = continue_prompts(target, prompts.draw(rng, count), length, decoding)
        rows.append(batch_rows)
        sizes.append(batch_sizes)
        done = sum(len(r) for r in rows)
        written = sum(length * len(r) - int(n.sum()) for r, n in zip(rows, sizes))
        log(f"{name}: {done}/{sequences} rows (temperature {decoding.temperature}) | {written / (time.perf_counter() - started):,.0f} generated tok/s")
    return np.concatenate(rows), np.concatenate(sizes)


def generate(target_dir: str | Path, data: str | Path, out: str | Path, sequences: int, eval_sequences: int, batch: int,
             prompt_tokens: int, new_tokens: int, temperatures: list[float], chat_share: float, even_sources: bool,
             minutes: float, dtype: str | None, seed: int, repetition_penalty: float = 1.0, min_p: float = 0.0,
             served_share: float = 0.0) -> Path:
    """Write `train.npy` and `eval.npy` (rows of prompt + continuation, `prompt_tokens +
    new_tokens` long), `train_prompts.npy` and `eval_prompts.npy` (each row's prompt
    length) and generated.json."""
    if not 0 <= served_share <= 1:
        raise ValueError(f"--served-share is a share of the prompts, within 0..1, not {served_share}")
    if not repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be positive, got {repetition_penalty}")
    if not 0 <= min_p < 1:
        raise ValueError(f"--min-p must be within [0, 1), got {min_p}")
    decodings = [Decoding(t, repetition_penalty, min_p) for t in temperatures]
    budget = Budget(minutes)
    model, config = load_model(target_dir, dtype=dtype)
    target = Lfm2Target(model, config, max_lanes=batch)
    tokenizer = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    header = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False).ids
    served = dict(served_share=served_share, **(document_marks(tokenizer) if served_share else {}))
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype_np = token_dtype(config.vocab_size)
    settings = dict(batch=batch, length=prompt_tokens + new_tokens, decodings=decodings, budget=budget)
    prompts = {part: Prompts(load_tokens(data, part), header, prompt_tokens, chat_share,
                             source_spans(data, part, prompt_tokens) if even_sources else None, **served) for part in ("train", "eval")}
    # The eval rows first: they are few, and a run cut short still leaves a usable set.
    held_out = generate_part(target, prompts["eval"], rng, eval_sequences, name="eval", **settings)
    train = generate_part(target, prompts["train"], rng, sequences, name="train", **settings)
    for part, (rows, sizes) in (("train", train), ("eval", held_out)):
        np.save(out / f"{part}.npy", rows.astype(dtype_np))
        np.save(out / f"{part}_prompts.npy", sizes.astype(np.int32))
    meta = {"target": str(target_dir), "data": str(data), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "temperatures": temperatures, "repetition_penalty": repetition_penalty, "min_p": min_p, "chat_share": chat_share,
            "even_sources": even_sources, "served_share": served_share, "train_rows": len(train[0]), "eval_rows": len(held_out[0])}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    log(f"generated {len(train[0])} train and {len(held_out[0])} eval rows of {prompt_tokens + new_tokens} tokens -> {out}")
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="regenerate drafter training text with the trained target", description=__doc__)
    p.add_argument("--target", required=True, help="the trained target's HF directory")
    p.add_argument("--data", required=True, help="the corpus step's directory (prompts come from it)")
    p.add_argument("--out", required=True, help="directory to write (give it to the drafter trainer as --data)")
    p.add_argument("--sequences", type=int, default=32768, help="train rows (default 32768)")
    p.add_argument("--eval-sequences", type=int, default=256, help="eval rows (default 256)")
    p.add_argument("--batch", type=int, default=1024, help="rows decoded together (default 1024)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,0.8", help="comma-separated; batches alternate over them (0: greedy)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL penalty over each row's tokens so far, every batch (default 1: none): text written as a "
                        "checkpoint's sampling defaults would write it")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p floor for the sampled batches (default 0: none)")
    p.add_argument("--chat-share", type=float, default=0.5, help="share of prompts that end where a chat reply begins (default 0.5)")
    p.add_argument("--served-share", type=float, default=0.0,
                   help="share of prompts cut as a user sends them (default 0): a chat example from its start token "
                        "to its reply, or the start token and a paragraph's opening tokens; shorter prompts get longer "
                        "continuations, so every row is PROMPT_TOKENS + NEW_TOKENS long")
    p.add_argument("--even-sources", action="store_true",
                   help="draw the other prompts evenly over the plain sources in DATA/corpus.json (default: by their tokens)")
    p.add_argument("--minutes", type=float, default=5.0, help="stop early and write what is done when spent")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast the target (default: as stored)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=lambda a: generate(
        a.target, a.data, a.out, a.sequences, a.eval_sequences, a.batch, a.prompt_tokens, a.new_tokens,
        [float(t) for t in a.temperatures.split(",")], a.chat_share, a.even_sources, a.minutes, a.dtype, a.seed,
        a.repetition_penalty, a.min_p, a.served_share))

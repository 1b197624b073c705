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
    """Fixed-length prompt windows of one part: a `chat_share` of them end where a chat
    reply begins, the rest lie anywhere, or in `spans` (one drawn uniformly per window)."""

    def __init__(self, tokens: np.ndarray, header: list[int], length: int, chat_share: float,
                 spans: list[tuple[int, int]] | None = None):
        self.tokens, self.length, self.chat_share = tokens, length, chat_share
        ends = reply_starts(tokens, header)
        self.reply_starts = ends[ends >= length]
        self.spans = spans or [(0, tokens.size)]

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        chats = rng.binomial(count, self.chat_share) if self.reply_starts.size else 0
        ends = rng.choice(self.reply_starts, size=chats)
        chat = [self.tokens[e - self.length : e].astype(np.int32) for e in ends]
        per_span = np.bincount(rng.integers(0, len(self.spans), size=count - chats), minlength=len(self.spans))
        plain = [random_windows(self.tokens[a:b], rng, n, self.length) for (a, b), n in zip(self.spans, per_span) if n]
        return np.concatenate(([np.stack(chat)] if chat else []) + plain)


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


def continue_prompts(target: Lfm2Target, prompts: np.ndarray, new_tokens: int, decoding: Decoding) -> np.ndarray:
    """Each prompt row [B, P] followed by `new_tokens` of the target's own: [B, P + new]."""
    lanes = [target.open_lane() for _ in range(len(prompts))]
    rows, seen = mx.arange(len(prompts)), None
    if decoding.repetition_penalty != 1.0:
        seen = mx.zeros((len(prompts), target.vocab_size), dtype=mx.bool_)
        seen = seen.at[rows[:, None], mx.array(prompts.astype(np.int32))].maximum(mx.array(True))
    try:
        out = target.forward(lanes, prompts.tolist(), logits="last")
        target.commit(out, [prompts.shape[1]] * len(lanes))
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
    return np.concatenate([prompts, np.array(produced, dtype=prompts.dtype).T], axis=1)


def generate_part(target: Lfm2Target, prompts: Prompts, rng: np.random.Generator, sequences: int, batch: int,
                  new_tokens: int, decodings: list[Decoding], budget: Budget, name: str) -> np.ndarray:
    """Up to `sequences` rows (fewer when the budget runs out, but at least one batch),
    batch after batch, the batches taking `decodings` in turn."""
    rows, started = [], time.perf_counter()
    while sum(len(r) for r in rows) < sequences and not (rows and budget.spent()):
        count = min(batch, sequences - sum(len(r) for r in rows))
        decoding = decodings[len(rows) % len(decodings)]
        rows.append(continue_prompts(target, prompts.draw(rng, count), new_tokens, decoding))
        done = sum(len(r) for r in rows)
        seconds = time.perf_counter() - started
        log(f"{name}: {done}/{sequences} rows (temperature {decoding.temperature}) | {done * new_tokens / seconds:,.0f} generated tok/s")
    return np.concatenate(rows)


def generate(target_dir: str | Path, data: str | Path, out: str | Path, sequences: int, eval_sequences: int, batch: int,
             prompt_tokens: int, new_tokens: int, temperatures: list[float], chat_share: float, even_sources: bool,
             minutes: float, dtype: str | None, seed: int, repetition_penalty: float = 1.0, min_p: float = 0.0) -> Path:
    """Write `train.npy` and `eval.npy` (rows of prompt + continuation) and generated.json."""
    if not repetition_penalty > 0:
        raise ValueError(f"--repetition-penalty must be positive, got {repetition_penalty}")
    if not 0 <= min_p < 1:
        raise ValueError(f"--min-p must be within [0, 1), got {min_p}")
    decodings = [Decoding(t, repetition_penalty, min_p) for t in temperatures]
    budget = Budget(minutes)
    model, config = load_model(target_dir, dtype=dtype)
    target = Lfm2Target(model, config, max_lanes=batch)
    header = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json")).encode(ASSISTANT_HEADER, add_special_tokens=False).ids
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype_np = token_dtype(config.vocab_size)
    settings = dict(batch=batch, new_tokens=new_tokens, decodings=decodings, budget=budget)
    prompts = {part: Prompts(load_tokens(data, part), header, prompt_tokens, chat_share,
                             source_spans(data, part, prompt_tokens) if even_sources else None) for part in ("train", "eval")}
    # The eval rows first: they are few, and a run cut short still leaves a usable set.
    held_out = generate_part(target, prompts["eval"], rng, eval_sequences, name="eval", **settings)
    train = generate_part(target, prompts["train"], rng, sequences, name="train", **settings)
    for part, rows in (("train", train), ("eval", held_out)):
        np.save(out / f"{part}.npy", rows.astype(dtype_np))
    meta = {"target": str(target_dir), "data": str(data), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "temperatures": temperatures, "repetition_penalty": repetition_penalty, "min_p": min_p, "chat_share": chat_share, "even_sources": even_sources, "train_rows": len(train),
            "eval_rows": len(held_out)}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    log(f"generated {len(train)} train and {len(held_out)} eval rows of {prompt_tokens}+{new_tokens} tokens -> {out}")
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
    p.add_argument("--even-sources", action="store_true",
                   help="draw the other prompts evenly over the plain sources in DATA/corpus.json (default: by their tokens)")
    p.add_argument("--minutes", type=float, default=5.0, help="stop early and write what is done when spent")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast the target (default: as stored)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=lambda a: generate(
        a.target, a.data, a.out, a.sequences, a.eval_sequences, a.batch, a.prompt_tokens, a.new_tokens,
        [float(t) for t in a.temperatures.split(",")], a.chat_share, a.even_sources, a.minutes, a.dtype, a.seed,
        a.repetition_penalty, a.min_p))

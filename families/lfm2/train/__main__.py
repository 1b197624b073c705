"""`python -m families.lfm2.train tokenizer|corpus|target|generate|drafter|confidence ...` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys

from . import __doc__ as GUIDE
from . import confidence, drafter, generate, target
from .corpus import tokenize_corpus
from .tokenizer import DEFAULT_VOCAB, train_tokenizer


def add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="train the byte-level BPE on the corpus's train part")
    p.add_argument("--corpus", required=True, help="directory of *.txt.xz sources")
    p.add_argument("--out", required=True, help="tokenizer directory to write")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"vocabulary size, specials included (default {DEFAULT_VOCAB})")
    p.add_argument("--max-chars", type=int, help="train on the first N characters only (smoke runs)")
    p.set_defaults(run=lambda a: train_tokenizer(a.corpus, a.out, a.vocab, a.max_chars))


def add_corpus(sub) -> None:
    p = sub.add_parser("corpus", help="split the corpus and tokenize it into train.npy / eval.npy")
    p.add_argument("--corpus", required=True, help="directory of *.txt.xz sources")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (the tokenizer step)")
    p.add_argument("--out", required=True, help="data directory to write")
    p.set_defaults(run=lambda a: tokenize_corpus(a.corpus, a.tokenizer, a.out))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m families.lfm2.train", description=GUIDE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run MLX on the CPU even where a GPU is present")
    sub = p.add_subparsers(dest="command", required=True)
    add_tokenizer(sub)
    add_corpus(sub)
    target.add_parser(sub)
    generate.add_parser(sub)
    drafter.add_parser(sub)
    confidence.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cpu:
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
    try:
        args.run(args)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

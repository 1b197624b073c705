"""The `laneserve` command line.

    laneserve generate [--model DIR] (--prompt TEXT | --chat TEXT | --prompt-ids 1,2,3) --max-tokens N ...
    laneserve make-tiny --kind lfm2|lfm2_moe|dspark --out DIR --seed N ...

Exit status: 0 done; 2 an error the user can act on (a bad flag, a malformed checkpoint,
a prompt the model cannot take, a file or port the system refuses, a device or machine
that runs out of memory), printed as one line naming the problem; 70 (sysexits'
EX_SOFTWARE) any other exception, which is a bug in laneserve: one line saying so, and
its traceback under --log-level DEBUG.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import traceback

import mlx.core as mx

from families.lfm2 import CheckpointError, open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.config import SAMPLING_KEYS, generation_defaults
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.client import EngineClient
from lanes.engine import Engine, EngineConfig, RequestError
from lanes.lane import Request
from lanes.lookup import check_min_ngram
from lanes.sampling import SamplingParams

from .serve import add_serve
from .service import ServiceError, add_service


class UsageError(Exception):
    """A command line that cannot be served as given."""


# What a user can cause and fix. Only these are reported as the user's: a ValueError or
# RuntimeError from deep inside is laneserve's own fault and must not read as a bad flag.
# Prompt lookup beside the drafter, from matches of at least this many tokens (lanes/lookup.py).
DEFAULT_PROMPT_LOOKUP = 2
USER_ERRORS = (UsageError, CheckpointError, RequestError, ServiceError, OSError)
USER_ERROR = 2
INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE
# How MLX's allocators say they found no memory (CUDA, Metal's two, the CPU's), which they
# raise as RuntimeError like a bug, wherever the allocation happened; and Python's own, as
# an engine thread reports it ("MemoryError: ...").
OUT_OF_MEMORY = ("out of memory", "insufficient memory", "unable to allocate", "greater than the maximum allowed buffer size",
                 "memoryerror")
LESS_MEMORY = "a smaller --dtype or model (serving: a lower --max-streams) needs less"


def ran_out_of_memory(error: BaseException | str | None) -> bool:
    """Whether an exception, or an error's message, says an allocator found no memory."""
    if isinstance(error, MemoryError):
        return True
    return error is not None and any(words in str(error).lower() for words in OUT_OF_MEMORY)


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers. Parsed after argparse, not as its `type=`: argparse lets
    only its own error types out of a converter as a usage message."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None


# Sizes as `ulimit` and `docker --memory` write them: a suffix is a power of 1024.
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE = re.compile(r"(\d+)([kmgt]?)", re.IGNORECASE)


def byte_size(text: str, flag: str) -> int:
    """Bytes, plain (1048576) or with a suffix K, M, G or T (1M). Parsed after argparse,
    as `int_list` is."""
    found = SIZE.fullmatch(text.strip())
    if found is None:
        raise UsageError(f"{flag} must be a number of bytes, optionally with K, M, G or T (4G), got {text!r}")
    return int(found.group(1)) * SIZE_UNITS[found.group(2).lower()]


def argv_text(text: str, flag: str) -> str:
    """Text from the command line, which Python decodes with surrogate escapes: bytes that
    are not UTF-8 arrive as lone surrogates no tokenizer can read."""
    bad = next((i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"), None)
    if bad is not None:
        raise UsageError(f"{flag} is not valid UTF-8 (byte 0x{ord(text[bad]) - 0xDC00:02x} at character {bad})")
    return text


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--model", help="target checkpoint directory (HF LFM2 / LFM2-MoE format); default: the embedded "
                   "small LFM2 and its DSpark drafter, trained by laneserve's own tools")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text (the tokenizer adds <|startoftext|>)")
    source.add_argument("--chat", help="one user message, rendered with the checkpoint's chat template")
    source.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--max-tokens", type=int, default=128)
    sampling = p.add_argument_group("sampling (default: the checkpoint's generation_config.json, else greedy and unfiltered)")
    sampling.add_argument("--temperature", type=float, help="0 = greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int, help="0 disables it")
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast weights (default: as stored; float32 when MLX runs on the CPU, whose bf16 kernels are slow)")
    add_drafting(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(run=run_generate)


def add_drafting(p) -> None:
    p.add_argument("--draft-model", help="a LiquidAI DSpark drafter directory paired with --model "
                   "(without --model, the embedded default's drafter)")
    p.add_argument("--no-draft", action="store_true", help="decode plainly even with a drafter")
    p.add_argument("--draft-width", type=int, help="fixed verify rows per drafted round (anchor + W-1 drafts); "
                   "default: priced each round from the drafter's confidences, with guards deciding whether to draft")
    p.add_argument("--drafter-bits", type=int, help="opt-in: quantize the drafter's linear layers to 8 bits at load "
                   "(MLX affine, group 64); default: the released weights as they are")
    p.add_argument("--prompt-lookup", type=int, default=DEFAULT_PROMPT_LOOKUP, metavar="N",
                   help="let a drafting lane copy drafts from where its last N or more tokens (N in 1..3) occurred before "
                   "in its prompt or reply, when that is worth more than the drafter's proposal; 0 drafts with the "
                   f"drafter only (default {DEFAULT_PROMPT_LOOKUP})")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each drafted round before building the next where they would otherwise overlap (a GPU "
                   "whose rounds are not priced live: CUDA, or any with --draft-width); to compare, or to rule them out")


def resolve_models(args) -> None:
    """No --model: the embedded default target, drafting with its own drafter. On the CPU,
    weights run in float32 unless --dtype says otherwise."""
    if args.model is None:
        args.model = default_target_dir()
        if args.draft_model is None:
            args.draft_model = default_drafter_dir()
    if args.dtype is None and mx.default_device() == mx.cpu:
        args.dtype = "float32"


def open_drafter(args, loaded):
    """The drafter the flags ask for, or None."""
    try:
        check_min_ngram(args.prompt_lookup)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.draft_model is None:
        if args.draft_width is not None or args.drafter_bits is not None:
            raise UsageError("--draft-width and --drafter-bits need --draft-model")
        return None
    drafter = load_drafter(
        args.draft_model, loaded.target.model, loaded.target.config, dtype=args.dtype, bits=args.drafter_bits,
        max_lanes=loaded.target.max_lanes,
    )
    widest = drafter.config.max_width + 1  # the anchor and every proposal the drafter was trained for
    if args.draft_width is not None and not 2 <= args.draft_width <= widest:
        raise UsageError(f"--draft-width must be within 2..{widest} (anchor + up to {widest - 1} drafts), got {args.draft_width}")
    logging.getLogger("laneserve").info(
        "drafter %s: %d proposals per round, %s weights", args.draft_model, drafter.width,
        f"{args.drafter_bits}-bit quantized" if args.drafter_bits else "released",
    )
    return drafter


def sampling_params(args) -> SamplingParams:
    """A flag wins over the checkpoint's generation_config.json, which wins over
    SamplingParams' own defaults (greedy, no filters)."""
    chosen = generation_defaults(args.model)
    for field in SAMPLING_KEYS:
        if getattr(args, field) is not None:
            chosen[field] = getattr(args, field)
    try:
        return SamplingParams(**chosen, seed=args.seed)
    except ValueError as e:  # a flag: the file's values were checked as it was read
        field, _, problem = str(e).partition(" ")  # SamplingParams' messages start with the field's name
        raise UsageError(f"--{field.replace('_', '-')} {problem}") from None


def run_generate(args) -> int:
    # Everything the flags alone decide is checked before the weights are read.
    resolve_models(args)
    sampling = sampling_params(args)
    stops = tuple(argv_text(stop, "--stop") for stop in args.stop)
    prompt_ids = int_list(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    chat = argv_text(args.chat, "--chat") if args.chat is not None else None
    raw = argv_text(args.prompt, "--prompt") if args.prompt is not None else None
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=1)
    tokenizer = loaded.tokenizer
    if prompt_ids is not None:
        prompt = prompt_ids
        bad = [t for t in prompt if not 0 <= t < loaded.target.vocab_size]
        if bad:
            raise UsageError(f"--prompt-ids holds ids outside the vocabulary (0..{loaded.target.vocab_size - 1}): {bad}")
    elif chat is not None:
        try:
            prompt = tokenizer.encode_chat([{"role": "user", "content": chat}])
        except ValueError as e:  # the checkpoint has no chat template, or its template refuses the message
            raise UsageError(f"--chat: {e}") from None
    else:
        prompt = tokenizer.encode(raw)
    drafter = open_drafter(args, loaded)
    engine = Engine(loaded.target, tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=1, draft_width=args.draft_width,
                                                                                   prompt_lookup=args.prompt_lookup,
                                                                                   overlap=False if args.no_overlap else None))
    client = EngineClient(engine)
    client.start(warm_up=drafter is not None and args.draft_width is None and not args.no_draft)
    try:
        if not client.wait_ready():
            raise RuntimeError(f"the engine failed to start: {client.health().error}")
        started = time.perf_counter()
        done = client.generate([Request(prompt, args.max_tokens, sampling, stops, draft=not args.no_draft)])[0]
        seconds = time.perf_counter() - started
    finally:
        client.shutdown(0)
    if done.error:  # past submit's checks, a lane ends in error only on an engine fault (logged where it happened)
        raise RuntimeError(f"the engine failed the request: {done.error}")
    if args.json:
        result = {
            "token_ids": done.token_ids,
            "text": done.text,
            "finish_reason": done.finish_reason.value,
            "prompt_tokens": done.prompt_tokens,
            "seconds": round(seconds, 4),
        }
        if drafter is not None:
            result["draft"] = done.draft.as_dict()
        print(json.dumps(result))
    else:
        print(done.text)
    return 0


def add_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a random checkpoint in the real on-disk format (tiny by default)")
    p.add_argument("--kind", required=True, choices=["lfm2", "lfm2_moe", "dspark"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", help="dspark: the target checkpoint the drafter pairs with")
    defaults = TinyShape()
    for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "ffn", "experts", "experts_per_token", "expert_ffn",
                 "dense_layers", "max_position"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"(targets: default {getattr(defaults, name)})")
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--expert-layout", choices=["per-expert", "fused"], default="per-expert")
    drafter = p.add_argument_group("dspark drafters (--layers, --heads, --kv-heads, --rope-theta apply too)")
    drafter.add_argument("--block-size", type=int, default=4)
    drafter.add_argument("--taps", help="target layer ids, comma-separated (default: three spread below the last)")
    drafter.add_argument("--rank", type=int, default=64, help="Markov head rank")
    drafter.add_argument("--head-dim", type=int, default=16)
    drafter.add_argument("--intermediate", type=int, default=128)
    p.set_defaults(run=run_make_tiny)


def run_make_tiny(args) -> int:
    given = {f: getattr(args, f) for f in TinyShape.__dataclass_fields__ if getattr(args, f, None) is not None}
    if args.kind == "dspark":
        if args.target is None:
            raise UsageError("make-tiny --kind dspark needs --target DIR (the target it drafts for)")
        out = make_tiny_drafter(
            args.out, args.target, args.seed, layers=given.get("layers", 2), block_size=args.block_size,
            taps=int_list(args.taps, "--taps") if args.taps else None, rank=args.rank,
            heads=given.get("heads", 4), kv_heads=given.get("kv_heads", 2), head_dim=args.head_dim,
            intermediate=args.intermediate, rope_theta=given.get("rope_theta", 1e4), dtype=args.dtype,
        )
    else:
        out = make_tiny_target(args.out, args.kind, args.seed, TinyShape(**given), args.dtype, args.expert_layout)
    print(out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laneserve", description="Serve LiquidAI LFM2 models on MLX with DSpark drafting.")
    p.add_argument("--log-level", default="INFO", help="INFO (default) logs startup facts such as the drafter's precision; DEBUG also every guard decision")
    sub = p.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_generate(sub)
    add_make_tiny(sub)
    add_service(sub)
    return p


def configure_logging(name: str) -> None:
    level = logging.getLevelNamesMapping().get(name.upper())
    if level is None:
        raise UsageError(f"--log-level {name!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        configure_logging(args.log_level)
        return args.run(args)
    except USER_ERRORS as e:
        print(f"laneserve: error: {e}", file=sys.stderr)
        return USER_ERROR
    except Exception as e:
        if ran_out_of_memory(e):
            print(f"laneserve: error: out of memory ({type(e).__name__}: {e}); {LESS_MEMORY}", file=sys.stderr)
            return USER_ERROR
        return report_bug(e, with_traceback=args.log_level.upper() == "DEBUG")


def report_bug(error: Exception, with_traceback: bool) -> int:
    """Anything outside USER_ERRORS. The flag, not the root logger's level, decides the
    traceback: basicConfig leaves a root logger already configured (by an embedding
    program, or pytest) as it is."""
    if with_traceback:
        traceback.print_exception(error, file=sys.stderr)
    hint = "" if with_traceback else "; rerun with --log-level DEBUG for the traceback"
    print(f"laneserve: internal error (a bug in laneserve, please report it): {type(error).__name__}: {error}{hint}",
          file=sys.stderr)
    return INTERNAL_ERROR


def exit_process(code: int) -> None:
    """Exit with `code` without running C++ static destructors. MLX (0.32) can abort the
    process at exit once its arrays were evaluated on a thread other than the main one
    (ml-explore/mlx#3126), which the engine thread always is: the work is done and
    flushed by then, so the exit status stays the command's own."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def entry() -> None:
    """The console script."""
    exit_process(main())


if __name__ == "__main__":
    entry()

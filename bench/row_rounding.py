"""Whether a verify's rows round as a one-row step does, on this backend.

    python -m bench.row_rounding --out DIR [--model DIR --drafter DIR] [--widths 2,9] [--name row-rounding]

Drafted output equals plain output token for token where the target's logits for a row
do not depend on how many rows its forward computes. A backend whose kernels take
another path for one row than for several (OpenBLAS preloaded on the CPU, a GPU) rounds
them differently, and a near-tie can then resolve differently (README, "Exactness").
For each held-out prompt of bench/default_prompts.json (by default with the embedded
default and its drafter's taps, as the engine asks for them), this reads all but the
prompt's last token once, then computes the next position's logits for that token alone
and as the first row of verify windows of each of `--widths` rows (the rest of the
window the prompt's first tokens), none of them committed. Per width: how many prompts'
logits differ at all from the one-row step's, the largest absolute difference, and how
many prompts' greedy choice differs. Writes NAME.json and NAME.md under --out, each with
its command, commit and machine.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from bench.bench_default import PROMPTS, encode
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.drafter import load_drafter


def first_row_logits(target, slot, window: list[int], taps: tuple[int, ...]) -> mx.array:
    """The logits of the window's first row after what `slot` holds: `[V]`. Never
    committed, so windows after it are read at the same positions."""
    logits = target.forward([slot], [window], logits="all", taps=taps).logits[0]
    mx.eval(logits)
    return logits


def run(args) -> dict:
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=1)
    target = loaded.target
    taps = load_drafter(args.drafter, target.model, target.config, dtype=args.dtype, max_lanes=1).tap_layers
    prompts = [encode(loaded.tokenizer, p) for p in json.loads(PROMPTS.read_text())["prompts"]]
    widths = {w: {"differ": 0, "max_abs_diff": 0.0, "argmax_differs": 0} for w in args.widths}
    for prompt in prompts:
        context, anchor = prompt[:-1], prompt[-1]
        slot = target.open_lane()
        try:
            target.commit(target.forward([slot], [context], logits="last", taps=taps), [len(context)])
            alone = first_row_logits(target, slot, [anchor], taps)
            for w, found in widths.items():
                within = first_row_logits(target, slot, [anchor] + [prompt[k % len(prompt)] for k in range(w - 1)], taps)
                difference = mx.max(mx.abs(within - alone)).item()
                found["differ"] += difference > 0
                found["max_abs_diff"] = max(found["max_abs_diff"], difference)
                found["argmax_differs"] += mx.argmax(within).item() != mx.argmax(alone).item()
        finally:
            target.close_lane(slot)
    return {**provenance(), "model": str(args.model), "drafter": str(args.drafter), "dtype": args.dtype or "as stored",
            "prompts": len(prompts), "taps": list(taps), "widths": widths}


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             f"{result['prompts']} held-out prompts, {result['dtype']}, the drafter's taps {result['taps']}: the next "
             "position's logits for the prompt's last token alone, against the same row first in a verify window.", "",
             "| window rows | prompts whose logits differ | largest absolute difference | prompts whose greedy choice differs |",
             "|---:|---:|---:|---:|"]
    for w, found in result["widths"].items():
        lines.append(f"| {w} | {found['differ']} | {found['max_abs_diff']:.3g} | {found['argmax_differs']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_target_dir())
    p.add_argument("--drafter", default=default_drafter_dir())
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="load as (default: float32 on the CPU, as stored elsewhere)")
    p.add_argument("--widths", default="2,9", help="verify window rows to compare with one row")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="row-rounding")
    args = p.parse_args()
    args.widths = [int(w) for w in args.widths.split(",") if w]
    if not args.widths or min(args.widths) < 2:
        p.error("--widths must name window sizes of 2 rows or more")
    if args.dtype is None and mx.default_device() == mx.cpu:
        args.dtype = "float32"
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

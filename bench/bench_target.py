"""laneserve's LFM2 target against mlx-lm's batched generator, side by side.

    python -m bench.bench_target --model DIR --out bench/results --name cpu-tiny-dense

Both systems load the same checkpoint into the same process and are measured in
alternation (laneserve first on even repeats, mlx-lm first on odd ones), so drift in
clocks, caches or thermal state falls on both alike. Every measurement runs once as
warm-up and then `--repeats` times; the median is reported.

- Prefill tok/s: one lane reads a random prompt of P tokens in chunks of `--chunk`
  rows, from empty caches to the prompt's last-row logits reduced to the first token.
  laneserve: `Lfm2Target.prefill` then argmax. mlx-lm: `BatchGenerator.insert` then
  `next_generated` until the first token comes back (P-1 rows of prompt processing and
  one decode step over the last row: the same P rows).
- Decode tok/s at N lanes: N distinct random prompts of P tokens are prefilled and
  their first tokens produced (untimed); then G greedy steps over all N lanes are
  timed, N*G / seconds. A laneserve step is a plain round: one ragged forward with
  one row per lane, argmax per row, commit, evaluation of the tokens and every cache
  write, tokens back to Python. An mlx-lm step is one `next_generated` call of a
  BatchGenerator holding exactly the N sequences (with its own asynchronous
  pipelining of the next step, as it serves).

Both sample greedily, so on the same weights they should emit the same tokens; the
report counts the lanes whose G+1 tokens agree (in bf16 an occasional near-tie can
split them, which says nothing about speed). Writes NAME.json (settings, every
repeat, medians) and NAME.md (a table: laneserve tok/s, mlx-lm tok/s, ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator

from families.lfm2.loader import DTYPES, load_model
from families.lfm2.target import Lfm2Target


def laneserve_prefill(target: Lfm2Target, prompt: list[int], chunk: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    lane = target.open_lane()
    logits, _ = target.prefill(lane, prompt, chunk)
    first = mx.argmax(logits).item()
    elapsed = time.perf_counter() - start
    target.close_lane(lane)
    return elapsed, [first]


def laneserve_decode(target: Lfm2Target, prompts: list[list[int]], gen: int, chunk: int) -> tuple[float, list[list[int]]]:
    lanes = [target.open_lane() for _ in prompts]
    last = [target.prefill(lane, prompt, chunk)[0] for lane, prompt in zip(lanes, prompts)]
    tokens = mx.argmax(mx.stack(last), axis=-1).tolist()
    emitted = [[t] for t in tokens]
    start = time.perf_counter()
    for _ in range(gen):
        out = target.forward(lanes, [[t] for t in tokens])
        chosen = mx.argmax(out.logits, axis=-1)
        target.commit(out, [1] * len(lanes))
        mx.eval(chosen, *target.state_arrays())
        tokens = chosen.tolist()
        for seq, t in zip(emitted, tokens):
            seq.append(t)
    elapsed = time.perf_counter() - start
    for lane in lanes:
        target.close_lane(lane)
    return elapsed, emitted


def mlx_lm_generator(model, lanes: int, gen: int, chunk: int) -> BatchGenerator:
    """A generator that takes all lanes into one prompt batch and one decode batch, and
    never stops a sequence early (no stop tokens, room past the timed steps)."""
    return BatchGenerator(
        model, max_tokens=gen + 2, stop_tokens=None, completion_batch_size=lanes,
        prefill_batch_size=lanes, prefill_step_size=chunk,
    )


def mlx_lm_prefill(model, prompt: list[int], chunk: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    generator = mlx_lm_generator(model, 1, 0, chunk)
    uids = generator.insert([prompt])
    first = [r.token for r in generator.next_generated()]
    elapsed = time.perf_counter() - start
    generator.remove(uids)
    generator.close()
    return elapsed, first


def mlx_lm_decode(model, prompts: list[list[int]], gen: int, chunk: int) -> tuple[float, list[list[int]]]:
    generator = mlx_lm_generator(model, len(prompts), gen, chunk)
    uids = generator.insert(prompts)
    emitted = {uid: [] for uid in uids}
    for r in generator.next_generated():  # prefill and the first token, untimed
        emitted[r.uid].append(r.token)
    start = time.perf_counter()
    for _ in range(gen):
        for r in generator.next_generated():
            emitted[r.uid].append(r.token)
    elapsed = time.perf_counter() - start
    generator.remove(uids)
    generator.close()
    return elapsed, [emitted[uid] for uid in uids]


def load_mlx_lm(path: str, dtype: str | None):
    """mlx-lm's model of the checkpoint, cast like laneserve's when `dtype` is given
    (sparing what its model keeps in float32, such as `expert_bias`)."""
    model, _ = mlx_lm.load(path)
    if dtype:
        keep = getattr(model, "cast_predicate", lambda name: True)
        cast = [(k, v.astype(DTYPES[dtype])) for k, v in tree_flatten(model.parameters()) if keep(k) and mx.issubdtype(v.dtype, mx.floating)]
        model.load_weights(cast, strict=False)
        mx.eval(model.parameters())
    return model


def run(args) -> dict:
    target_model, config = load_model(args.model, args.dtype)
    target = Lfm2Target(target_model, config, max_lanes=max(args.widths))
    peer = load_mlx_lm(args.model, args.dtype)
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(16, config.vocab_size, size=(max(args.widths), args.prompt_tokens)).tolist()

    cases = [("prefill", 1)] + [("decode", n) for n in args.widths]
    samples = {f"{kind}@{n}": {"laneserve": [], "mlx_lm": [], "agree": None} for kind, n in cases}
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for kind, n in cases:
            if kind == "prefill":
                systems = {
                    "laneserve": lambda: laneserve_prefill(target, prompts[0], args.chunk),
                    "mlx_lm": lambda: mlx_lm_prefill(peer, prompts[0], args.chunk),
                }
                tokens = args.prompt_tokens
            else:
                systems = {
                    "laneserve": lambda: laneserve_decode(target, prompts[:n], args.gen_tokens, args.chunk),
                    "mlx_lm": lambda: mlx_lm_decode(peer, prompts[:n], args.gen_tokens, args.chunk),
                }
                tokens = n * args.gen_tokens
            order = ["laneserve", "mlx_lm"] if repeat % 2 == 0 else ["mlx_lm", "laneserve"]
            emitted = {}
            for name in order:
                elapsed, emitted[name] = systems[name]()
                if repeat:
                    samples[f"{kind}@{n}"][name].append(tokens / elapsed)
            agree = sum(a == b for a, b in zip(emitted["laneserve"], emitted["mlx_lm"]))
            samples[f"{kind}@{n}"]["agree"] = f"{agree}/{n}"
            if repeat:
                print(f"repeat {repeat}: {kind} at {n} lane(s): "
                      + ", ".join(f"{s} {samples[f'{kind}@{n}'][s][-1]:.1f} tok/s" for s in ("laneserve", "mlx_lm")), flush=True)
    rows = []
    for kind, n in cases:
        s = samples[f"{kind}@{n}"]
        ours, theirs = statistics.median(s["laneserve"]), statistics.median(s["mlx_lm"])
        rows.append({"measure": kind, "lanes": n, "laneserve_tok_s": ours, "mlx_lm_tok_s": theirs,
                     "ratio": ours / theirs, "agree": s["agree"], "laneserve_samples": s["laneserve"], "mlx_lm_samples": s["mlx_lm"]})
    return {
        "command": "python -m bench.bench_target " + shlex.join(sys.argv[1:]),
        "model": str(args.model),
        "model_type": config.model_type,
        "dtype": args.dtype or "as stored",
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "device": str(mx.default_device()),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "commit": subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip(),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, before and after: contention
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# laneserve vs mlx-lm {result['mlx_lm']}: {Path(result['model']).name}",
        "",
        f"- command: `{result['command']}`",
        f"- model: {result['model_type']}, dtype {result['dtype']}; device {result['device']}, {result['machine']}; "
        f"mlx {result['mlx']}; laneserve commit {result['commit']}",
        f"- prompt {result['prompt_tokens']} tokens (chunk {result['chunk']}), {result['gen_tokens']} timed decode "
        f"steps per lane; median of {result['repeats']} repeats after a warm-up; peak MLX memory {result['peak_memory_gb']:.2f} GB",
        f"- 1-minute load average before / after: {result['load_average'][0]:.2f} / {result['load_average'][1]:.2f} "
        "(other processes' load slows both systems alike but adds noise)",
        "- 'agree': lanes whose greedy tokens are identical in both systems",
        "",
        "| measure | lanes | laneserve tok/s | mlx-lm tok/s | ratio | agree |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['measure']} | {r['lanes']} | {r['laneserve_tok_s']:.1f} | {r['mlx_lm_tok_s']:.1f} | {r['ratio']:.2f}x | {r['agree']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (HF LFM2 / LFM2-MoE)")
    parser.add_argument("--out", required=True, help="results directory")
    parser.add_argument("--name", help="base name of the result files (default: the model directory's name)")
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk rows, for both systems")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast both models to this dtype (default: as stored)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parser.parse_args()
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or Path(args.model).name
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

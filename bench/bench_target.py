"""What laneserve serves against mlx-lm's batched generator: decode throughput, side by side.

    python -m bench.bench_target --model DIR --out bench/results --name cpu-tiny-dense
        [--widths 1,4,8,16] [--prompt-tokens 512] [--gen-tokens 128] [--min-seconds 5] [--alternations 5] [--cublas]

Both systems load the same checkpoint into the same process and decode the same prompts
greedily. laneserve runs as it serves: its `Engine` with no drafter, so every round is a
plain round, pipelined (the next round is built while the device runs this one), with
its admission, detokenizing and event publishing. mlx-lm runs its `BatchGenerator`
holding exactly N sequences (its own pipelining included). Only the decode phase is
timed: for each batch of N distinct random prompts of P tokens, every prompt is read and
its first token produced untimed, then G tokens per lane are timed, N*G tokens over the
wall time. A run repeats such batches until its timed decode reaches `--min-seconds`
(noise on a shared machine is large against a one-second run). Per width the systems
alternate `--alternations` times (each going first in turn) after one untimed batch each;
reported: each system's median tok/s with its min and max, and the median, min and max of
the per-alternation ratio (the runs of an alternation ran back to back). `--cublas` adds
the engine again with every product of several rows through MLX's own kernels (`by_rows`
off: cuBLASLt for the linear maps, gather_mm for a MoE's experts), to measure laneserve's
row and expert kernels side by side. Neither stops at an eos
token, so both decode all G tokens; 'agree' counts the lanes of each width's first batch whose tokens are identical
in both: on a checkpoint drawn as is, bf16 near-ties split them (which says nothing about
speed); on a decisive one (`random_checkpoint --decisive`), as on a trained model, every
lane should agree. Writes NAME.json
(settings, every run) and NAME.md.
"""

from __future__ import annotations

import argparse
import os
import time
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator

from bench.bench_engine import read_prompts
from bench.provenance import markdown_line, median_range, provenance, spread, write_result
from families.lfm2 import open_target
from families.lfm2.loader import DTYPES
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request


class LaneserveDecode:
    """The engine as served, plain rounds only, never stopping at an eos token."""

    def __init__(self, loaded, lanes: int):
        self.engine = Engine(loaded.target, loaded.tokenizer, (), None, EngineConfig(max_streams=lanes))
        self.engine.warm_up()

    def batch(self, prompts: list[list[int]], gen: int) -> tuple[float, int, list[list[int]]]:
        """Seconds and tokens of the timed decode, and every lane's tokens. Prompts are
        read in slices between rounds, so lanes whose prompt is read early decode a few
        tokens before the last prompt is read: those are not timed and not counted."""
        decoded = {"timing": False, "tokens": 0}
        emitted: dict[str, list[int]] = {}

        def on_event(event):
            emitted.setdefault(event.request_id, []).extend(event.token_ids)
            if decoded["timing"]:
                decoded["tokens"] += len(event.token_ids)

        requests = [Request(p, gen + 1, on_event=on_event) for p in prompts]  # the first token comes with the prompt
        read_prompts(self.engine, requests)
        decoded["timing"] = True
        start = time.perf_counter()
        self.engine.run_until_idle()
        elapsed = time.perf_counter() - start
        produced = sum(len(tokens) for tokens in emitted.values())
        if produced != len(prompts) * (gen + 1):
            raise RuntimeError(f"laneserve produced {produced} tokens, expected {len(prompts) * (gen + 1)}")
        return elapsed, decoded["tokens"], [emitted[r.id] for r in requests]


class MlxLmDecode:
    def __init__(self, model, chunk: int):
        self.model = model
        self.chunk = chunk

    def batch(self, prompts: list[list[int]], gen: int) -> tuple[float, int, list[list[int]]]:
        generator = BatchGenerator(
            self.model, max_tokens=gen + 2, stop_tokens=None, completion_batch_size=len(prompts),
            prefill_batch_size=len(prompts), prefill_step_size=self.chunk,
        )
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
        return elapsed, len(prompts) * gen, [emitted[uid] for uid in uids]


def timed_run(system, make_prompts, gen: int, min_seconds: float) -> dict:
    """Batches until the timed decode reaches min_seconds; tok/s over all of them."""
    seconds, tokens, batches = 0.0, 0, 0
    while seconds < min_seconds or batches == 0:
        prompts = make_prompts()
        elapsed, timed, _ = system.batch(prompts, gen)
        seconds += elapsed
        tokens += timed
        batches += 1
    return {"tok_s": tokens / seconds, "seconds": seconds, "batches": batches}


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
    record = provenance()
    loaded = open_target(args.model, dtype=args.dtype, max_lanes=max(args.widths))
    systems = {"laneserve": LaneserveDecode(loaded, max(args.widths)), "mlx_lm": MlxLmDecode(load_mlx_lm(args.model, args.dtype), args.chunk)}
    if args.cublas:  # the engine again, every product of several rows through MLX's own kernels
        plain = open_target(args.model, dtype=args.dtype, max_lanes=max(args.widths), by_rows=False)
        systems["laneserve_cublas"] = LaneserveDecode(plain, max(args.widths))
    vocab = loaded.target.vocab_size
    rng = np.random.default_rng(args.seed)
    load_before = os.getloadavg()[0]
    rows = []
    for n in args.widths:
        make_prompts = lambda n=n: rng.integers(16, vocab, size=(n, args.prompt_tokens)).tolist()
        first = make_prompts()
        tokens = {name: system.batch(first, args.gen_tokens)[2] for name, system in systems.items()}  # untimed
        agree = sum(a == b for a, b in zip(tokens["laneserve"], tokens["mlx_lm"]))
        runs = {name: [] for name in systems}
        ratios = {name: [] for name in systems if name != "mlx_lm"}
        for alternation in range(args.alternations):
            names = list(systems)
            order = names[alternation % len(names):] + names[:alternation % len(names)]  # each goes first in turn
            for name in order:
                runs[name].append(timed_run(systems[name], make_prompts, args.gen_tokens, args.min_seconds))
            for name in ratios:
                ratios[name].append(runs[name][-1]["tok_s"] / runs["mlx_lm"][-1]["tok_s"])
            print(f"width {n}, alternation {alternation + 1}: " + ", ".join(
                f"{name} {runs[name][-1]['tok_s']:.1f} tok/s ({runs[name][-1]['seconds']:.1f} s)" for name in order
            ) + f", ratio {ratios['laneserve'][-1]:.2f}", flush=True)
        row = {"lanes": n, "agree": f"{agree}/{n}", "ratio": spread(ratios["laneserve"]), "runs": runs}
        if args.cublas:
            row["cublas_ratio"] = spread(ratios["laneserve_cublas"])
            row["kernel_gain"] = spread([a["tok_s"] / b["tok_s"] for a, b in zip(runs["laneserve"], runs["laneserve_cublas"])])
        for name in systems:
            row[f"{name}_tok_s"] = spread([r["tok_s"] for r in runs[name]])
        rows.append(row)
    return {
        **record,
        "model": str(args.model),
        "model_type": loaded.target.config.model_type,
        "dtype": args.dtype or "as stored",
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "min_seconds": args.min_seconds,
        "alternations": args.alternations,
        "cublas": args.cublas,
        "mlx_lm": version("mlx-lm"),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, before and after: contention
        "rows": rows,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# laneserve's engine vs mlx-lm {result['mlx_lm']} BatchGenerator: {Path(result['model']).name}",
        "",
        markdown_line(result),
        f"- model: {result['model_type']}, dtype {result['dtype']}; peak MLX memory {result['peak_memory_gb']:.2f} GB",
        (f"- decode only: prompts of {result['prompt_tokens']} tokens read untimed, then {result['gen_tokens']} timed tokens "
        f"per lane; each run at least {result['min_seconds']} s of decode; {result['alternations']} alternations; "
        "median [min-max] over alternations; the ratio is taken per alternation"),
        f"- 1-minute load average before / after: {result['load_average'][0]:.2f} / {result['load_average'][1]:.2f}",
        "- 'agree': lanes whose greedy tokens are identical in both systems (first batch of each width)",
        "",
        "| lanes | laneserve tok/s | mlx-lm tok/s | laneserve / mlx-lm | agree |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['lanes']} | {median_range(r['laneserve_tok_s'], 1)} | {median_range(r['mlx_lm_tok_s'], 1)} | "
                     f"{median_range(r['ratio'], 2, 'x')} | {r['agree']} |")
    if result.get("cublas"):
        lines += ["", "The engine again with every product of several rows through MLX's own kernels (cuBLASLt, and "
                  "gather_mm for experts), in the same alternations (`--cublas`); laneserve's kernels' gain is "
                  "laneserve / this, per alternation:", "",
                  "| lanes | laneserve (cuBLASLt) tok/s | its / mlx-lm | laneserve / laneserve (cuBLASLt) |",
                  "| ---: | ---: | ---: | ---: |"]
        for r in result["rows"]:
            lines.append(f"| {r['lanes']} | {median_range(r['laneserve_cublas_tok_s'], 1)} | "
                         f"{median_range(r['cublas_ratio'], 2, 'x')} | {median_range(r['kernel_gain'], 2, 'x')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (HF LFM2 / LFM2-MoE)")
    parser.add_argument("--out", required=True, help="results directory")
    parser.add_argument("--name", help="base name of the result files (default: the model directory's name)")
    parser.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--min-seconds", type=float, default=5.0, help="timed decode per run, at least")
    parser.add_argument("--alternations", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=512, help="mlx-lm's prefill step (laneserve reads prompts its own way)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast both models to this dtype (default: as stored)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--cublas", action="store_true",
                        help="also run the engine with every product of several rows through MLX's own kernels (by_rows off)")
    args = parser.parse_args()
    result = run(args)
    name = args.name or Path(args.model).name
    write_result(args.out, name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

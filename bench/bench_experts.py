"""A step's expert products for a few rows: laneserve's expert kernel against MLX's gather_mm.

    python -m bench.bench_experts --model DIR --out bench/results/gpu --name experts-8b
        [--rows 1,2,4,8,16] [--seconds 2] [--turns 5]

Loads a mixture-of-experts target as served (w1|w3 merged) and takes every MoE layer's
experts: one step's expert products. For each row count R, a pass routes R random rows
to k distinct random experts in every layer and evaluates the experts' SwiGLU for all
layers together, as a step would, either as MLX's `gather_mm` (the (row, expert) pairs
sorted by expert once there are 64 of them, as mlx-lm does: `Experts.__call__` without
the kernel) or by `families.lfm2.expert_kernel` (CUDA only). The two alternate `--turns`
times, each turn repeating passes for `--seconds`; reported per R: each one's median
milliseconds per pass with min and max, and the median, min and max of the per-turn
ratio. Before timing, the kernel's outputs are checked against gather_mm's in float32 for
each R: the largest difference, as a share of the largest value. Writes NAME.json and
NAME.md.
"""

from __future__ import annotations

import mlx.core as mx

from bench.bench_rows import alternated, main_with
from bench.provenance import markdown_line, median_range, provenance, spread
from families.lfm2 import expert_kernel, open_target
from families.lfm2.model import Experts, SparseMoE


def products(layers: list[Experts], xs: list[mx.array], chosen: list[mx.array], kernel: bool) -> list[mx.array]:
    if kernel:
        return [e.kernel_products(x, c) for e, x, c in zip(layers, xs, chosen)]
    return [e(x, c) for e, x, c in zip(layers, xs, chosen)]


def routed(rows: int, experts: int, k: int) -> mx.array:
    """[rows, k] distinct random experts per row, as a router's top k."""
    return mx.argpartition(mx.random.uniform(shape=(rows, experts)), kth=k - 1, axis=-1)[:, :k].astype(mx.int32)


def run(args) -> dict:
    if not expert_kernel.available():
        raise SystemExit("bench_experts: the expert kernel runs on CUDA only (MLX's default device has no CUDA)")
    model = open_target(args.model, max_lanes=1, by_rows=False).target.model
    moe = [layer.feed_forward for layer in model.layers if isinstance(layer.feed_forward, SparseMoE)]
    if not moe:
        raise SystemExit(f"bench_experts: {args.model} has no mixture-of-experts layers")
    layers = [m.experts for m in moe]
    experts, hidden, k = model.config.num_experts, model.config.hidden_size, moe[0].top_k
    record = provenance()
    cells = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = [mx.random.normal((rows, hidden)).astype(model.embed_tokens.weight.dtype) for _ in layers]
        chosen = [routed(rows, experts, k) for _ in layers]
        kernel_out, gather_out = products(layers, xs, chosen, True), products(layers, xs, chosen, False)
        mx.eval(kernel_out, gather_out)
        a, b = kernel_out[0].astype(mx.float32).reshape(rows, k, -1), gather_out[0].astype(mx.float32)
        difference = (mx.abs(a - b).max() / mx.abs(b).max()).item()
        turns = [{"kernel_ms": ms[True], "gather_ms": ms[False], "ratio": ms[False] / ms[True]}
                 for ms in alternated(lambda kernel: products(layers, xs, chosen, kernel), args.turns, args.seconds)]
        cells.append({"rows": rows, "difference": difference, "turns": turns,
                      "kernel_ms": spread([t["kernel_ms"] for t in turns]),
                      "gather_ms": spread([t["gather_ms"] for t in turns]),
                      "speedup": spread([t["ratio"] for t in turns])})
        print(f"rows {rows}: kernel {cells[-1]['kernel_ms']['median']:.3f} ms, gather_mm "
              f"{cells[-1]['gather_ms']['median']:.3f} ms, {cells[-1]['speedup']['median']:.2f}x", flush=True)
    return {**record, "settings": vars(args), "layers": len(layers), "experts": experts, "per_row": k,
            "weight_bytes": sum(m.weight.nbytes for e in layers for m in e.maps()), "cells": cells}


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             (f"{result['layers']} MoE layers a pass, {result['experts']} experts, {result['per_row']} per row "
              f"({result['weight_bytes'] / 1e9:.2f} GB of expert weights in all)."), "",
             "| rows | expert kernel ms | gather_mm ms | gather_mm / kernel | largest difference |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for c in result["cells"]:
        lines.append(f"| {c['rows']} | {median_range(c['kernel_ms'], 3)} | {median_range(c['gather_ms'], 3)} | "
                     f"{median_range(c['speedup'], 3, 'x')} | {c['difference']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    main_with(__doc__, run, markdown, "experts", "1,2,4,8,16")


if __name__ == "__main__":
    main()

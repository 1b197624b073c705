"""A step's weight products for a few rows: laneserve's row kernel against MLX's matmul.

    python -m bench.bench_rows --model DIR --out bench/results/gpu --name rows-2.6b
        [--rows 2,4,8,9,16] [--seconds 2] [--turns 5]

Loads the target as served (projections merged) and takes every unquantized linear map
of it, in layer order, and the tied head: one step's products. For each row count M, a
pass multiplies M random rows by every one of those weights and evaluates them
together, either as `x @ w.T` (MLX: cuBLASLt for M > 1) or by
`families.lfm2.row_kernel` (CUDA only): host time and device time together. The
products of a pass do not depend on each other, as a step's do, so the GPU may run
several side by side; what one product costs the device alone is `bench.row_launches`'. The two alternate `--turns` times, each turn
repeating passes for `--seconds`; reported per M: each one's median milliseconds per
pass with min and max, and the median, min and max of the per-turn ratio. One row, which
MLX serves by its own GEMV, is measured as matmul alone for scale. Before timing, each
distinct weight shape's kernel products are checked against float32 products: the
largest difference, as a share of the largest float32 value, for the kernel and for
MLX's matmul in the weights' dtype. Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from bench.provenance import markdown_line, median_range, provenance, spread, write_result
from families.lfm2 import open_target, row_kernel


def step_weights(model: nn.Module) -> list[mx.array]:
    """Every unquantized linear map's weight in module order, then the tied head's table."""
    weights = [m.weight for _, m in model.named_modules() if type(m) is nn.Linear]
    return weights + [model.embed_tokens.weight]


def products(weights: list[mx.array], xs: list[mx.array], kernel: bool) -> list[mx.array]:
    if kernel:
        return [row_kernel.rows_times_weight(x, w) for x, w in zip(xs, weights)]
    return [x @ w.T for x, w in zip(xs, weights)]


def time_passes(outputs, seconds: float) -> float:
    """Median milliseconds to build and evaluate `outputs()`, repeated for `seconds`."""
    times = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        mx.eval(outputs())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def alternated(passes, turns: int, seconds: float) -> list[dict[bool, float]]:
    """Median ms of `passes(kernel)` with the kernel (True) and without, for `seconds`
    each, in `turns` turns, each side going first in turn."""
    results = []
    for turn in range(turns):
        order = (True, False) if turn % 2 == 0 else (False, True)
        results.append({kernel: time_passes(lambda: passes(kernel), seconds) for kernel in order})
    return results


def main_with(doc: str, run, markdown, name: str, rows: str) -> None:
    """The command line a kernel benchmark shares: parse, run, print and write NAME.{json,md}."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default=name)
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    result = run(args)
    print(markdown(result))
    write_result(args.out, args.name, result, markdown(result))


def agreement(weight: mx.array, rows: int) -> dict:
    x = mx.random.normal((rows, weight.shape[1])).astype(weight.dtype)
    exact = x.astype(mx.float32) @ weight.astype(mx.float32).T
    scale = mx.abs(exact).max()
    kernel = row_kernel.rows_times_weight(x, weight).astype(mx.float32)
    matmul = (x @ weight.T).astype(mx.float32)
    return {"shape": list(weight.shape), "rows": rows,
            "kernel": (mx.abs(kernel - exact).max() / scale).item(),
            "matmul": (mx.abs(matmul - exact).max() / scale).item()}


def run(args) -> dict:
    if not row_kernel.available():
        raise SystemExit("bench_rows: the row kernel runs on CUDA only (MLX's default device has no CUDA)")
    loaded = open_target(args.model, max_lanes=1, by_rows=False)
    weights = step_weights(loaded.target.model)
    record = provenance()
    shapes = {tuple(w.shape): w for w in weights}
    checks = [agreement(w, rows) for w in shapes.values() for rows in (2, 9, 16)]
    rows_list = [int(r) for r in args.rows.split(",")]
    xs1 = [mx.random.normal((1, w.shape[1])).astype(w.dtype) for w in weights]
    one_row = time_passes(lambda: products(weights, xs1, False), args.seconds)
    cells = []
    for rows in rows_list:
        xs = [mx.random.normal((rows, w.shape[1])).astype(w.dtype) for w in weights]
        mx.eval(xs, products(weights, xs, True), products(weights, xs, False))  # compile, plan
        turns = [{"kernel_ms": ms[True], "matmul_ms": ms[False], "ratio": ms[False] / ms[True]}
                 for ms in alternated(lambda kernel: products(weights, xs, kernel), args.turns, args.seconds)]
        cells.append({"rows": rows, "turns": turns,
                      "kernel_ms": spread([t["kernel_ms"] for t in turns]),
                      "matmul_ms": spread([t["matmul_ms"] for t in turns]),
                      "speedup": spread([t["ratio"] for t in turns])})
        print(f"rows {rows}: kernel {cells[-1]['kernel_ms']['median']:.3f} ms, matmul "
              f"{cells[-1]['matmul_ms']['median']:.3f} ms, {cells[-1]['speedup']['median']:.2f}x", flush=True)
    return {**record, "settings": vars(args), "maps": len(weights),
            "weight_bytes": sum(w.nbytes for w in weights), "one_row_matmul_ms": one_row,
            "agreement": checks, "cells": cells}


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             (f"{result['maps']} products a pass ({result['weight_bytes'] / 1e9:.2f} GB of weights); "
              f"one row by MLX's GEMV: {result['one_row_matmul_ms']:.3f} ms a pass."), "",
             "| rows | row kernel ms | MLX matmul ms | matmul / kernel |", "| ---: | ---: | ---: | ---: |"]
    for c in result["cells"]:
        lines.append(f"| {c['rows']} | {median_range(c['kernel_ms'], 3)} | {median_range(c['matmul_ms'], 3)} | "
                     f"{median_range(c['speedup'], 3, 'x')} |")
    lines += ["", "Largest difference from float32 products, as a share of the largest value:", "",
              "| weight | rows | row kernel | MLX matmul |", "| --- | ---: | ---: | ---: |"]
    for a in result["agreement"]:
        lines.append(f"| {a['shape'][0]} x {a['shape'][1]} | {a['rows']} | {a['kernel']:.2e} | {a['matmul']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    main_with(__doc__, run, markdown, "rows", "2,4,8,9,16")


if __name__ == "__main__":
    main()

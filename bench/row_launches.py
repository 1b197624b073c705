"""The row kernel's launches (families/lfm2/row_kernel.py `LAUNCHES`) per weight shape, in
device time counted by CUPTI, beside MLX's GEMV for one row and its matmul (CUDA only).

    python -m bench.row_launches --model CK/2.6b --out DIR [--name row-launches-2.6b] [--rows 2,9,16] [--turns 5]

Loads the target as served and takes one step's weight products (`bench_rows.step_weights`),
grouped by shape. For each row count and shape, a turn multiplies random rows by every
weight of that shape once per launch, in a shuffled order, then once by MLX's matmul and
once as one row by its GEMV, each product evaluated alone (as a step's products, which
depend on each other, run one after another), all under torch.profiler (torch is on the GPU machine, not a
dependency of laneserve), whose CUPTI records give each kernel's device time; the launch
is read back from the kernel's name (its template constants). A group's weights are read
in turn, and every group but the tied head's holds more than the L2 cache, so a product
reads its weight from memory as it does in a step. Reported per shape and launch: the
median over turns of microseconds per product and the weight bytes read per second; per
launch, the sum over one step's products; and the best launch per shape. Before timing,
every launch's products are checked against float32 products (the largest difference as
a share of the largest value). Writes NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import statistics

from bench.provenance import markdown_line, provenance, write_result

LAUNCH_NAME = re.compile(r"rows_times_weight_\w*?_(\d+)_(\d+)_(\d+)_([tf])\(")


def launch_of(kernel_name: str):
    """The row kernel's launch from its kernel's name (…_WARPS_DEPTH_TILES_ADJACENT), or None."""
    from families.lfm2.row_kernel import Launch

    found = LAUNCH_NAME.search(kernel_name)
    return Launch(int(found[1]), int(found[2]), int(found[3]), found[4] == "t") if found else None


def label(launch) -> str:
    """E.g. '16w x2 t2 adj': 16 warps, 2 loads in flight, 2 tiles, a warp's loads side by side."""
    return f"{launch.warps}w x{launch.depth}{f' t{launch.tiles}' if launch.tiles > 1 else ''}{' adj' if launch.adjacent else ''}"


def device_times(profile_fn) -> dict[str, float]:
    """Microseconds of device time in all, keyed by the row kernel's launch label, 'gemv'
    (MLX's one-row GEMV) or 'matmul' (every other kernel), over one profiled call."""
    import mlx.core as mx
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profile_fn()
        mx.synchronize()
    times = collections.Counter()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0) > 0:
            launch = launch_of(event.key)
            times[label(launch) if launch else "gemv" if "gemv" in event.key else "matmul"] += event.self_device_time_total
    return times


def run(args) -> dict:
    import torch  # before MLX, so CUPTI is set up for the process

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    import mlx.core as mx

    from bench.bench_rows import step_weights
    from families.lfm2 import open_target, row_kernel

    if not row_kernel.available():
        raise SystemExit("row_launches: the row kernel runs on CUDA only (MLX's default device has no CUDA)")
    loaded = open_target(args.model, max_lanes=1, by_rows=False)
    weights = step_weights(loaded.target.model)
    groups = collections.defaultdict(list)
    for w in weights:
        groups[tuple(w.shape)].append(w)
    launches = list(row_kernel.LAUNCHES)
    record = provenance()
    agreement = []
    for shape, group in groups.items():
        w = group[0]
        x = mx.random.normal((args.check_rows, w.shape[1])).astype(w.dtype)
        exact = x.astype(mx.float32) @ w.astype(mx.float32).T
        scale = mx.abs(exact).max()
        errors = {label(launch): (mx.abs(row_kernel.rows_times_weight(x, w, launch).astype(mx.float32) - exact).max() / scale).item()
                  for launch in launches}
        agreement.append({"shape": list(shape), "rows": args.check_rows, "errors": errors})
        print(f"checked {shape}: largest {max(errors.values()):.2e}", flush=True)
    rng = random.Random(0)
    cells = []
    for rows in (int(r) for r in args.rows.split(",")):
        for shape, group in groups.items():
            xs = [mx.random.normal((rows, w.shape[1])).astype(w.dtype) for w in group]
            ones = [x[:1] for x in xs]
            mx.eval(xs, ones)

            def turn(order):
                # One product an evaluation: independent products in one graph would run
                # side by side on the GPU and lengthen each other's kernels.
                for launch in order:
                    for x, w in zip(xs, group):
                        mx.eval(row_kernel.rows_times_weight(x, w, launch))
                for x, w in zip(xs, group):
                    mx.eval(x @ w.T)
                for x, w in zip(ones, group):
                    mx.eval(x @ w.T)

            turn(launches)  # compile every launch, plan the matmul
            per_turn = collections.defaultdict(list)
            for _ in range(args.turns):
                order = launches[:]
                rng.shuffle(order)
                for key, total in device_times(lambda: turn(order)).items():
                    per_turn[key].append(total / len(group))
            nbytes = group[0].nbytes
            us = {key: statistics.median(values) for key, values in per_turn.items()}
            cells.append({"rows": rows, "shape": list(shape), "count": len(group), "weight_bytes": nbytes,
                          "us": us, "us_turns": dict(per_turn), "tb_s": {key: nbytes / v / 1e6 for key, v in us.items()}})
            best = min((key for key in us if key not in ("gemv", "matmul")), key=us.get)
            print(f"rows {rows} {shape} x{len(group)}: best {best} {us[best]:.1f} us ({cells[-1]['tb_s'][best]:.2f} TB/s), "
                  f"served {us[label(row_kernel.launch_for(*shape))]:.1f}, matmul {us.get('matmul', float('nan')):.1f}, "
                  f"gemv {us.get('gemv', float('nan')):.1f}", flush=True)
    return {**record, "settings": vars(args), "launches": [label(launch) for launch in launches],
            "agreement": agreement, "cells": cells}


def markdown(result: dict) -> str:
    from families.lfm2.row_kernel import launch_for

    launches = result["launches"]
    lines = [markdown_line(result), "",
             "Device time per product (CUPTI), median over turns, and the weight read per second; "
             "'best' is the fastest launch for the shape, 'served' what `launch_for` picks "
             "(launches: `row_kernel.Launch`, labelled warps, loads in flight, tiles, 'adj' for a warp's loads side by side).", ""]
    by_rows = collections.defaultdict(list)
    for cell in result["cells"]:
        by_rows[cell["rows"]].append(cell)
    for rows, cells in by_rows.items():
        lines += [f"### {rows} rows", "",
                  "| weight | per step | best launch | best us (TB/s) | served | served us (TB/s) "
                  "| matmul us (TB/s) | one-row GEMV us (TB/s) |",
                  "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
        step = collections.Counter()
        for cell in cells:
            us, tb = cell["us"], cell["tb_s"]
            best = min(launches, key=lambda key: us.get(key, float("inf")))
            served = label(launch_for(*cell["shape"]))
            lines.append(f"| {cell['shape'][0]} x {cell['shape'][1]} | {cell['count']} | {best} | {us[best]:.1f} ({tb[best]:.2f}) | "
                         f"{served} | {us[served]:.1f} ({tb[served]:.2f}) | "
                         f"{us['matmul']:.1f} ({tb['matmul']:.2f}) | "
                         f"{us['gemv']:.1f} ({tb['gemv']:.2f}) |")
            for key in [*launches, "matmul", "gemv"]:
                step[key] += us[key] * cell["count"]
            step["best per shape"] += us[best] * cell["count"]
            step["served"] += us[served] * cell["count"]
        lines += ["", "One step's products, ms of device time:", "", "| launch | ms |", "| --- | ---: |"]
        for key, total in sorted(step.items(), key=lambda kv: kv[1]):
            lines.append(f"| {key} | {total / 1e3:.3f} |")
        lines.append("")
    lines += ["Largest difference from float32 products, as a share of the largest value, over every launch:", "",
              "| weight | rows | largest | launch |", "| --- | ---: | ---: | --- |"]
    for a in result["agreement"]:
        worst = max(a["errors"], key=a["errors"].get)
        lines.append(f"| {a['shape'][0]} x {a['shape'][1]} | {a['rows']} | {a['errors'][worst]:.2e} | {worst} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="row-launches")
    parser.add_argument("--rows", default="2,9,16")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=9)
    args = parser.parse_args()
    result = run(args)
    print(markdown(result))
    write_result(args.out, args.name, result, markdown(result))


if __name__ == "__main__":
    main()

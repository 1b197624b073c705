"""Where a plain decode step's time goes: the host building its graph, the host launching
it, the device finishing it, and how long the GPU's kernels themselves run.

    python -m bench.step_anatomy --model DIR --out bench/results/NAME [--lanes 1,16] [--kernels]

For each lane count, after every lane has read a random prompt of `--context` tokens, a
plain step (target forward with one row per lane, argmax, commit) is timed in three
parts, each the median over `--steps` synchronous steps after a warm-up:

- build: the Python that makes the lazy graph;
- launch: `mx.async_eval` returning, the backend encoding and launching every kernel;
- wait: `mx.synchronize` returning, the device finishing what is still running.

`--kernels` also runs three steps of the engine and three of mlx-lm's BatchGenerator
(same checkpoint, same lane count) under Nsight Compute (`ncu`, which must be on PATH)
and sums `gpu__time_duration` per kernel name: the device time of a step with launch
gaps and host work left out (ncu runs kernels one at a time at base clocks, so it is a
measure to compare the two systems by, not a step time).

Writes NAME.json and NAME.md (`--name`, default step-anatomy) under --out, each with its
command, commit and machine.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import io
import statistics
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np

from bench.bench_step import PeerSteps, PlainSteps
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target

NCU_METRIC = "gpu__time_duration.sum"


def prompts_for(lanes: int, context: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(20, 4000, context)] for _ in range(lanes)]


def engine_steps(target, prompts: list[list[int]]) -> PlainSteps:
    slots = [target.open_lane() for _ in prompts]
    last = []
    for slot, prompt in zip(slots, prompts):
        logits, _ = target.prefill(slot, prompt, chunk=512)
        last.append(mx.argmax(logits))
    return PlainSteps(target, slots, mx.stack(last).astype(mx.int32), ())


def anatomy(steps: PlainSteps, count: int) -> dict:
    """Median milliseconds of build, launch and wait over `count` synchronous steps."""
    parts = {"build_ms": [], "launch_ms": [], "wait_ms": []}
    for i in range(count + 5):
        started = time.perf_counter()
        outputs = steps.build()
        built = time.perf_counter()
        mx.async_eval(outputs)
        launched = time.perf_counter()
        mx.synchronize()
        done = time.perf_counter()
        if i >= 5:
            for key, seconds in zip(parts, (built - started, launched - built, done - launched)):
                parts[key].append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in parts.items()}


def profiled_child(system: str, model: str, lanes: int, context: int) -> None:
    """Three steps of `system` between cuProfilerStart and cuProfilerStop (run under ncu)."""
    prompts = prompts_for(lanes, context)
    if system == "laneserve":
        steps = engine_steps(open_target(model, max_lanes=lanes).target, prompts)
        step = lambda: mx.eval(steps.build())
    else:
        step = PeerSteps(model, None, prompts).step
    for _ in range(8):
        step()
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(3):
        step()
    mx.synchronize()
    cuda.cuProfilerStop()


def kernel_times(system: str, model: str, lanes: int, context: int) -> dict:
    """Per-step device microseconds by kernel name for `system`, from ncu's CSV."""
    command = ["ncu", "--profile-from-start", "off", "--metrics", NCU_METRIC, "--csv", "--print-units", "base",
               sys.executable, "-m", "bench.step_anatomy", "--child", system, "--model", model,
               "--lanes", str(lanes), "--context", str(context), "--out", "-"]
    text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = csv.DictReader(io.StringIO(text[text.find('"ID"'):]))
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for row in rows:
        if row.get("Metric Name") == NCU_METRIC:
            entry = by_name[row["Kernel Name"].split("(")[0]]
            entry[0] += 1
            entry[1] += float(row["Metric Value"].replace(",", "")) / 1e3  # ns -> us
    kernels = {name: {"per_step": count / 3, "us_per_step": total / 3} for name, (count, total) in by_name.items()}
    return {"device_ms_per_step": sum(k["us_per_step"] for k in kernels.values()) / 1e3,
            "kernels_per_step": sum(k["per_step"] for k in kernels.values()), "kernels": kernels}


def run(args) -> dict:
    record = provenance()
    result = {**record, "model": args.model, "context": args.context, "steps": args.steps, "lanes": {}}
    target = open_target(args.model, max_lanes=max(args.lanes)).target
    for lanes in args.lanes:
        steps = engine_steps(target, prompts_for(lanes, args.context))
        cell = anatomy(steps, args.steps)
        for slot in steps.slots:
            target.close_lane(slot)
        if args.kernels:
            cell["device"] = {system: kernel_times(system, args.model, lanes, args.context) for system in ("laneserve", "mlx-lm")}
        result["lanes"][lanes] = cell
        print(f"lanes {lanes}: " + ", ".join(f"{k} {v:.3f}" for k, v in cell.items() if k.endswith("_ms")), flush=True)
    return result


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             f"Context {result['context']} tokens, dtype as stored; medians of {result['steps']} synchronous steps.", "",
             "| lanes | build ms | launch ms | wait ms |", "|---:|---:|---:|---:|"]
    for lanes, c in result["lanes"].items():
        lines.append(f"| {lanes} | {c['build_ms']:.3f} | {c['launch_ms']:.3f} | {c['wait_ms']:.3f} |")
    for lanes, c in result["lanes"].items():
        if "device" not in c:
            continue
        lines += ["", f"Kernel time per step under ncu at {lanes} lanes (base clocks, kernels one at a time):", ""]
        for system, d in c["device"].items():
            lines.append(f"- {system}: {d['device_ms_per_step']:.3f} ms in {d['kernels_per_step']:.0f} kernels; "
                         "the five largest: " + "; ".join(
                             f"{name} {k['us_per_step']:.0f} us ({k['per_step']:.0f})"
                             for name, k in sorted(d["kernels"].items(), key=lambda kv: -kv[1]["us_per_step"])[:5]))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="step-anatomy")
    p.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kernels", action="store_true", help="also sum kernel times per step under ncu, against mlx-lm")
    p.add_argument("--child", choices=["laneserve", "mlx-lm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        profiled_child(args.child, args.model, args.lanes[0], args.context)
        return
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

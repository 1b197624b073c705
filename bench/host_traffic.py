"""What host traffic costs the small kernels after it, on CUDA (CUPTI through the GPU
machine's torch).

    python -m bench.host_traffic --out DIR [--name host-traffic] [--iterations 300] [--turns 5] [--lanes 16]

Sessions 16 and 18 counted the engine's kernels (`gpu/session16/kernels-dc633b9/`,
`gpu/session18/kernels-22f256c/`): in drafted rounds and 16-lane plain steps, kernels
that only make a few hundred ints (an arange, an int add or multiply, a gather of ids)
averaged 30-120 us of device time, against 1-3 us in one-lane plain steps. One reading of
MLX's CUDA allocator (mlx/backend/cuda/allocator.cpp) explains it: an array made from
host data lives in managed memory, a device array the host reads is moved into managed
memory, and freed buffers of either kind are recycled, by size alone, for any later
array. A kernel whose input or output lies on a page the host touched last then waits
while the page migrates. Arrays of at most 8 bytes come from a small managed pool of
their own, which the device maps instead of migrating.

This probe tests that reading. One iteration builds the index arithmetic a round does
(lane offsets plus an arange, times a capacity, plus slot rows, a gather from a device
table: about seven kernels, `--lanes` lanes of `WIDTH` rows) and evaluates it, with the
offsets coming from, and the result going to:

- device: offsets kept on the device and advanced there; nothing read;
- host input: offsets made from a Python list each iteration;
- cached host input: the same host-made offsets every iteration (made once, never freed);
- scalar host input: device offsets plus the host's one int (an array of 4 bytes);
- host read: as device, then the result read to a list;
- host input and read: both, as a round does.

The regimes run in turns (`--turns`, the order rotating), each for `--iterations`
iterations under torch.profiler. Per regime, medians over turns: kernels and device
microseconds per iteration, the average microseconds of each kernel name, the CUDA
runtime calls that allocate, free or copy memory per iteration, and the wall
microseconds per iteration (with the profiler's own overhead). If the reading holds,
the kernels are slow where the host made or read arrays larger than 8 bytes and fast in
the other regimes. Writes NAME.json and NAME.md under --out.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

try:  # before MLX, so CUPTI is set up for the process (torch is on the GPU machine, not a dependency)
    import torch
except ImportError:
    torch = None
import mlx.core as mx

from bench.kernel_counts import tally
from bench.provenance import markdown_line, median_range, provenance, spread, write_result

REGIMES = ("device", "host input", "cached host input", "scalar host input", "host read", "host input and read")
WIDTH = 16  # rows per lane: a verify window's bucket
CAPACITY = 4096  # positions per slot in the gathered table
HEADS = 2


class Iterations:
    """The iterations of every regime over `lanes` lanes, their state kept between them."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.start = list(range(0, 64 * lanes, 64))  # each lane's first position
        self.device_offsets = mx.array(self.start, dtype=mx.int32)
        self.cached_offsets = mx.array(self.start, dtype=mx.int32)
        self.slots = mx.arange(lanes, dtype=mx.int32)
        self.table = mx.arange(lanes * HEADS * CAPACITY, dtype=mx.int32)
        self.step = 0
        mx.eval(self.device_offsets, self.cached_offsets, self.slots, self.table)

    def offsets(self, regime: str) -> mx.array:
        """This iteration's lane offsets (lazy), from where `regime` takes them."""
        self.step = (self.step + 1) % (CAPACITY - 64 * self.lanes - WIDTH)
        if regime in ("host input", "host input and read"):
            return mx.array([s + self.step for s in self.start], dtype=mx.int32)
        if regime == "cached host input":
            return self.cached_offsets
        if regime == "scalar host input":
            return self.cached_offsets + self.step
        self.device_offsets = (self.device_offsets + 1) % (CAPACITY - WIDTH)
        return self.device_offsets

    def ids(self, offsets: mx.array) -> mx.array:
        """Every lane's rows' ids in the table, `[lanes * HEADS * WIDTH]` (lazy): lane i,
        head h, row w at `(slot_i * HEADS + h) * CAPACITY + offset_i + w`."""
        positions = offsets[:, None] + mx.arange(WIDTH, dtype=mx.int32)[None, :]
        rows = (self.slots[:, None, None] * HEADS + mx.arange(HEADS, dtype=mx.int32)[None, :, None]) * CAPACITY
        return self.table[(rows + positions[:, None, :]).reshape(-1)]

    def run(self, regime: str) -> list[int] | None:
        """One iteration, evaluated; its ids read to the host where the regime reads."""
        ids = self.ids(self.offsets(regime))
        mx.eval(ids)
        return ids.tolist() if regime.endswith("read") else None


def profiled(fn, iterations: int) -> dict:
    """Kernels and memory calls of `iterations` calls of `fn`, per iteration."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        for _ in range(iterations):
            fn()
        mx.synchronize()
        wall = time.perf_counter() - began
    kernels, device_us, calls, _ = tally(prof)
    return {"kernels": sum(kernels.values()) / iterations, "device_us": sum(device_us.values()) / iterations,
            "wall_us": 1e6 * wall / iterations, "calls": {k: c / iterations for k, c in calls.items()},
            "kernel_us": {k: device_us[k] / c for k, c in kernels.items()}}


def summary(turns: list[dict]) -> dict:
    """A regime's turns as medians (with spread for the per-iteration figures)."""
    names = {k for t in turns for k in t["kernel_us"]}
    calls = {k for t in turns for k in t["calls"]}
    return {
        **{key: spread([t[key] for t in turns]) for key in ("kernels", "device_us", "wall_us")},
        "kernel_us": {k: statistics.median(t["kernel_us"][k] for t in turns if k in t["kernel_us"]) for k in sorted(names)},
        "calls": {k: statistics.median(t["calls"].get(k, 0.0) for t in turns) for k in sorted(calls)},
    }


def short(kernel: str) -> str:
    """A kernel's name without its argument list, e.g. `mlx::core::cu::arange<int, int, 4>`."""
    return kernel.split("(")[0].removeprefix("void ")


def markdown(result: dict) -> str:
    regimes = result["regimes"]
    lines = [f"# Host traffic and the kernels after it, {result['lanes']} lanes", "", markdown_line(result),
             f"- {result['iterations']} iterations per regime and turn, {result['turns']} turns; medians over turns [min-max]", "",
             "| regime | kernels per iteration | device us per iteration | wall us per iteration | memory calls per iteration |",
             "|---|---:|---:|---:|---|"]
    for name, r in regimes.items():
        calls = ", ".join(f"{k} {v:.2f}" for k, v in r["calls"].items() if v) or "none"
        lines.append(f"| {name} | {r['kernels']['median']:.1f} | {median_range(r['device_us'], 1)} | "
                     f"{median_range(r['wall_us'], 1)} | {calls} |")
    kernels = sorted({k for r in regimes.values() for k in r["kernel_us"]})
    lines += ["", "Average device microseconds per kernel:", "",
              "| kernel | " + " | ".join(regimes) + " |", "|---|" + "---:|" * len(regimes)]
    for k in kernels:
        cells = [f"{r['kernel_us'][k]:.1f}" if k in r["kernel_us"] else "" for r in regimes.values()]
        lines.append(f"| `{short(k)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="host-traffic")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--lanes", type=int, default=16)
    args = parser.parse_args()
    from families.lfm2 import cuda

    if not cuda.available() or torch is None:
        raise SystemExit("host_traffic: needs MLX's CUDA backend and torch (whose profiler reads CUPTI); "
                         f"{'torch is not installed' if torch is None else 'MLX has no CUDA device'}")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    iterations = Iterations(args.lanes)
    for regime in REGIMES:  # warm: every kernel built, the allocator's caches filled
        for _ in range(20):
            iterations.run(regime)
    per_regime = collections.defaultdict(list)
    for turn in range(args.turns):
        for regime in REGIMES[turn % len(REGIMES):] + REGIMES[: turn % len(REGIMES)]:
            per_regime[regime].append(profiled(lambda: iterations.run(regime), args.iterations))
        print(f"turn {turn + 1}/{args.turns}", flush=True)
    result = {**provenance(), "lanes": args.lanes, "iterations": args.iterations, "turns": args.turns,
              "regimes": {regime: summary(per_regime[regime]) for regime in REGIMES}}
    report = markdown(result)
    write_result(args.out, args.name, result, report)
    print(report)


if __name__ == "__main__":
    main()

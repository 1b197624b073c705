"""The CUDA kernels an engine launches per round, by name, counted by CUPTI (CUDA only).

    python -m bench.kernel_counts --model CK/2.6b --drafter CK/2.6b-dspark --out DIR [--gen 128] [--lanes 1,16] [--phases]

On the H200 a round's time is the host's time per launched kernel (bench/results/README.md),
so the count of kernels per round is what a change to the round's operations moves, and
unlike a time it does not drift between machine starts. For each lane count, a plain
engine and one drafting at the published profile (scripted acceptance, bench.scripted)
each decode `--gen` tokens per lane once to warm every trace and kernel, then again with
their decoding (not the prompts' reading) under torch.profiler, whose CUPTI activity
records see every kernel of the process, MLX's included (torch is on the GPU machine,
not a dependency of laneserve). Writes
`table-{plain,drafted}-N.txt` (torch.profiler's table by call count: kernels with their
device time, and the CUDA API calls with their host time) and `kernel-counts.json`
(the command, commit and machine, and per run: rounds, drafted rounds, tokens, seconds,
kernels, device time, kernels by name, and the CUDA runtime calls that allocate, free,
copy or wait, by name with their host time: MLX's allocator moves an array between
device and managed memory with them, which the tables' 80 rows may leave out). `rounds`
is summed over lanes, as bench_engine counts them: kernels per round are a run's kernels
over its rounds per lane (drafted runs hold a few plain rounds where the guard chose them).

`--phases` also decodes once more with the round runner's clock replaced by `PhaseMarks`:
at every reading of the clock (the runner reads it where each phase of a round ends) the
device finishes its work and runs a marker kernel named for the line that read it. The
kernels between two markers are the phase ending at the second, so each phase's kernels
are counted by name (`phases` in the JSON, `phases-{plain,drafted}-N.txt`), with their
device time: which of a round's phases launch what. The waits change the run's timing,
not its kernels.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import time

import numpy as np

# CUDA runtime calls by which MLX's allocator takes, moves and gives back memory, and waits.
MEMORY_CALLS = ("cudaMalloc", "cudaFree", "cudaMemcpy", "cudaMemAdvise", "cudaMemPrefetch", "cudaStreamSynchronize",
                "cudaDeviceSynchronize", "cudaEventSynchronize")


def tally(prof) -> tuple[collections.Counter, collections.Counter, collections.Counter, collections.Counter]:
    """A torch.profiler run's kernels by name (counts, device us) and its MEMORY_CALLS by
    name (counts, host us)."""
    kernels, device_us = collections.Counter(), collections.Counter()
    calls, host_us = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0) > 0:
            kernels[event.key] += event.count
            device_us[event.key] += getattr(event, "self_device_time_total", 0)
        elif event.key.startswith(MEMORY_CALLS):
            calls[event.key] += event.count
            host_us[event.key] += event.self_cpu_time_total
    return kernels, device_us, calls, host_us


MARK = re.compile(r"laneserve_phase_mark_(\d+)_")
AFTER_LAST_MARK = "(after the last mark)"


class PhaseMarks:
    """A RoundRunner clock that marks the device's kernel stream where it is read: it
    waits for the device, then runs a one-thread kernel named `laneserve_phase_mark_I_`,
    I numbering the line that read the clock (`sites`: "function:line" -> I)."""

    def __init__(self):
        self.sites: dict[str, int] = {}
        self._kernels: dict[int, object] = {}

    def __call__(self) -> float:
        import mlx.core as mx

        caller = sys._getframe(1)
        index = self.sites.setdefault(f"{caller.f_code.co_name}:{caller.f_lineno}", len(self.sites))
        if index not in self._kernels:
            self._kernels[index] = mx.fast.cuda_kernel(name=f"laneserve_phase_mark_{index}_", input_names=["x"],
                                                       output_names=["y"], source="y[0] = x[0];")
        mx.synchronize()
        (marked,) = self._kernels[index](inputs=[mx.zeros((1,), dtype=mx.int32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                                         output_shapes=[(1,)], output_dtypes=[mx.int32])
        mx.eval(marked)
        return time.perf_counter()


def by_phase(kernels: list[tuple[float, str, float]], sites: dict[str, int]) -> dict[str, dict]:
    """Kernels `(device start, name, device us)` of a marked run, by the phase each belongs
    to: the site of the next marker after it (AFTER_LAST_MARK past the last one). Per
    site: `marks` (how often the clock was read there), `kernels`, `device_us`, and
    `by_name` {name: [count, device us]}."""
    site_of = {index: site for site, index in sites.items()}
    phases: dict[str, dict] = {}
    pending: list[tuple[str, float]] = []

    def phase(site: str) -> dict:
        return phases.setdefault(site, {"marks": 0, "kernels": 0, "device_us": 0.0, "by_name": {}})

    def close(entry: dict) -> None:
        for name, us in pending:
            entry["kernels"] += 1
            entry["device_us"] += us
            count = entry["by_name"].setdefault(name, [0, 0.0])
            count[0] += 1
            count[1] += us
        pending.clear()

    for _, name, us in sorted(kernels):
        mark = MARK.search(name)
        if mark is None:
            pending.append((name, us))
            continue
        entry = phase(site_of[int(mark.group(1))])
        entry["marks"] += 1
        close(entry)
    if pending:
        close(phase(AFTER_LAST_MARK))
    return phases


def phases_table(phases: dict[str, dict], rounds: float, top: int = 12) -> str:
    """A marked run's phases as text: per site, kernels and device us per round, then its
    `top` kernels by count."""
    lines = []
    for site, entry in phases.items():
        lines.append(f"{site}: marks {entry['marks']}, kernels per round {entry['kernels'] / rounds:.1f}, "
                     f"device us per round {entry['device_us'] / rounds:.1f}")
        for name, (count, us) in sorted(entry["by_name"].items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"    {count / rounds:7.1f} a round {us / count:8.1f} us  {name[:110]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gen", type=int, default=128, help="tokens each lane decodes per run")
    parser.add_argument("--lanes", default="1,16", help="lane counts")
    parser.add_argument("--phases", action="store_true", help="also count each round phase's kernels (PhaseMarks)")
    args = parser.parse_args()
    import torch  # before MLX, so CUPTI is set up for the process
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    import mlx.core as mx

    from bench.bench_engine import Setup, decode_run
    from bench.provenance import provenance
    from bench.scripted import published_profile

    def profiled_run(engine, prompts):
        """decode_run with its decoding under the profiler: (run, profile)."""
        profiled = {}

        @contextlib.contextmanager
        def decoding():
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                yield
                mx.synchronize()
            profiled["prof"] = prof

        return decode_run(engine, prompts, args.gen, decoding), profiled["prof"]

    setup = Setup(argparse.Namespace(model=args.model, drafter=args.drafter, dtype=None, decisive=1 / 32), 16)
    rng = np.random.default_rng(0)
    os.makedirs(args.out, exist_ok=True)
    counts = {}
    for n in (int(x) for x in args.lanes.split(",")):
        prompts = setup.prompts(rng, n, 256)
        recorded = decode_run(setup.plain, prompts, args.gen + 64)["tokens"]
        drafted = setup.scripted(published_profile(), [p + t for p, t in zip(prompts, recorded)])
        for name, engine in (("plain", setup.plain), ("drafted", drafted)):
            decode_run(engine, prompts, args.gen)
            mx.synchronize()
            run, prof = profiled_run(engine, prompts)
            kernels, device_us, calls, host_us = tally(prof)
            key = f"{name}-{n}"
            counts[key] = {"run": {k: run[k] for k in ("rounds", "drafted_rounds", "decode_tokens", "seconds")},
                           "kernels": sum(kernels.values()), "device_us": sum(device_us.values()),
                           "by_name": sorted(([k, c, device_us[k]] for k, c in kernels.items()), key=lambda x: -x[1]),
                           "memory_calls": sorted(([k, c, host_us[k]] for k, c in calls.items()), key=lambda x: -x[1])}
            print(key, counts[key]["run"], "kernels", counts[key]["kernels"], "device ms", counts[key]["device_us"] / 1e3, flush=True)
            with open(os.path.join(args.out, f"table-{key}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="count", row_limit=80))
            if args.phases:
                clock, engine.rounds.clock = engine.rounds.clock, PhaseMarks()
                marked, prof = profiled_run(engine, prompts)
                marks, engine.rounds.clock = engine.rounds.clock, clock
                events = [(e.time_range.start, e.name, e.time_range.elapsed_us()) for e in prof.events()
                          if e.device_type.name == "CUDA"]
                phases = by_phase(events, marks.sites)
                rounds = marked["rounds"] / n
                counts[key]["phases"] = {"run": {k: marked[k] for k in ("rounds", "drafted_rounds", "decode_tokens", "seconds")},
                                         "sites": marks.sites, "by_site": phases}
                with open(os.path.join(args.out, f"phases-{key}.txt"), "w") as f:
                    f.write(phases_table(phases, rounds))
            # Written after every run: torch.profiler has ended this process mid-run before (session 18).
            with open(os.path.join(args.out, "kernel-counts.json"), "w") as f:
                json.dump({**provenance(), "gen_tokens": args.gen, "runs": counts}, f, indent=1)
        del drafted


if __name__ == "__main__":
    main()

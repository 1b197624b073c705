"""The CUDA kernels an engine launches per round, by name, counted by CUPTI (CUDA only).

    python -m bench.kernel_counts --model CK/2.6b --drafter CK/2.6b-dspark --out DIR [--gen 128] [--lanes 1,16]

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
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os

import numpy as np

# CUDA runtime calls by which MLX's allocator takes, moves and gives back memory, and waits.
MEMORY_CALLS = ("cudaMalloc", "cudaFree", "cudaMemcpy", "cudaMemAdvise", "cudaMemPrefetch", "cudaStreamSynchronize",
                "cudaDeviceSynchronize", "cudaEventSynchronize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gen", type=int, default=128, help="tokens each lane decodes per run")
    parser.add_argument("--lanes", default="1,16", help="lane counts")
    args = parser.parse_args()
    import torch  # before MLX, so CUPTI is set up for the process
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    import mlx.core as mx

    from bench.bench_engine import Setup, decode_run
    from bench.provenance import provenance
    from bench.scripted import published_profile

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
            profiled = {}

            @contextlib.contextmanager
            def decoding():
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    yield
                    mx.synchronize()
                profiled["prof"] = prof

            run = decode_run(engine, prompts, args.gen, decoding)
            prof = profiled["prof"]
            kernels, device_us = collections.Counter(), collections.Counter()
            calls, host_us = collections.Counter(), collections.Counter()
            for event in prof.key_averages():
                if event.device_type.name == "CUDA" or getattr(event, "self_device_time_total", 0) > 0:
                    kernels[event.key] += event.count
                    device_us[event.key] += getattr(event, "self_device_time_total", 0)
                elif event.key.startswith(MEMORY_CALLS):
                    calls[event.key] += event.count
                    host_us[event.key] += event.self_cpu_time_total
            key = f"{name}-{n}"
            counts[key] = {"run": {k: run[k] for k in ("rounds", "drafted_rounds", "decode_tokens", "seconds")},
                           "kernels": sum(kernels.values()), "device_us": sum(device_us.values()),
                           "by_name": sorted(([k, c, device_us[k]] for k, c in kernels.items()), key=lambda x: -x[1]),
                           "memory_calls": sorted(([k, c, host_us[k]] for k, c in calls.items()), key=lambda x: -x[1])}
            print(key, counts[key]["run"], "kernels", counts[key]["kernels"], "device ms", counts[key]["device_us"] / 1e3, flush=True)
            with open(os.path.join(args.out, f"table-{key}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="count", row_limit=80))
        del drafted
    with open(os.path.join(args.out, "kernel-counts.json"), "w") as f:
        json.dump({**provenance(), "gen_tokens": args.gen, "runs": counts}, f, indent=1)


if __name__ == "__main__":
    main()

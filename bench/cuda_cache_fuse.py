"""Whether MLX's CUDA graph cache ends a process that meets many graph shapes, with and
without laneserve's backend defaults (families/backend.py).

    python -m bench.cuda_cache_fuse --out bench/results/NAME [--capacity 3] [--graphs 40]

MLX's CUDA backend caches graph executables by topology in an LRU of
MLX_CUDA_GRAPH_CACHE_SIZE entries and, unless MLX_ENABLE_CACHE_THRASHING_CHECK is 0,
raises "Cache thrashing is happening" once its misses over the process's life pass
twice that. A server meets new topologies for as long as it runs; this shrinks the cache
to `--capacity` so the fuse is reached in `--graphs` evaluations, each of a chain of a
new length. Two child processes run the same loop: `bare` imports only MLX, `laneserve`
imports `families` first. Needs a CUDA device. Writes NAME.json and NAME.md (`--name`,
default cuda-cache-fuse) under --out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.provenance import markdown_line, provenance, write_result

CHILD = """
import sys
if sys.argv[1] == "laneserve":
    import families  # noqa: F401 -- its backend defaults are what is measured
import mlx.core as mx
assert mx.default_device() == mx.gpu and mx.cuda.is_available(), "needs MLX's CUDA backend"
for n in range(1, int(sys.argv[2]) + 1):
    x = mx.ones((4, 4))
    for k in range(n):  # a chain of n kernels: a topology no earlier evaluation had
        x = mx.exp(x) * 0.5 if k % 2 else mx.sin(x) + 1
    try:
        mx.eval(x)
    except RuntimeError as error:
        print(f"failed at graph {n}: {error}")
        raise SystemExit(1)
print(f"all {sys.argv[2]} graphs evaluated")
"""


def run(args) -> dict:
    result = {**provenance(), "capacity": args.capacity, "graphs": args.graphs, "systems": {}}
    for system in ("bare", "laneserve"):
        env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_CACHE_THRASHING_CHECK"}
        env["MLX_CUDA_GRAPH_CACHE_SIZE"] = str(args.capacity)
        done = subprocess.run([sys.executable, "-c", CHILD, system, str(args.graphs)], env=env, capture_output=True, text=True, check=False)
        lines = (done.stdout + done.stderr).strip().splitlines()
        result["systems"][system] = {"survived": done.returncode == 0, "said": lines[-1] if lines else ""}
        print(f"{system}: {result['systems'][system]}", flush=True)
    return result


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             f"MLX_CUDA_GRAPH_CACHE_SIZE={result['capacity']}, {result['graphs']} evaluations each of a new graph topology.", "",
             "| process | survived | last line |", "|---|---|---|"]
    for system, r in result["systems"].items():
        lines.append(f"| {system} | {'yes' if r['survived'] else 'no'} | {r['said']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--capacity", type=int, default=3, help="MLX_CUDA_GRAPH_CACHE_SIZE for both children")
    p.add_argument("--graphs", type=int, default=40, help="evaluations, each a new topology")
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="cuda-cache-fuse")
    args = p.parse_args()
    import mlx.core as mx

    if not mx.cuda.is_available():
        raise SystemExit("bench.cuda_cache_fuse needs MLX's CUDA backend (pip install 'mlx[cuda]' on an NVIDIA machine)")
    result = run(args)
    write_result(args.out, args.name, result, markdown(result))
    print(json.dumps(result["systems"]))


if __name__ == "__main__":
    main()

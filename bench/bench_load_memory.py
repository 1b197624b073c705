"""Peak memory while loading a checkpoint, against the size of its weight files.

    python -m bench.bench_load_memory --model DIR --out bench/results --name cpu-lfm2.5-2.6b-bf16

Each load runs in a fresh Python subprocess, so nothing from an earlier load or import
counts. The child imports MLX and the loader, reads its peak resident set size
(VmHWM in /proc/self/status; ru_maxrss where /proc is missing) as the baseline, loads
the checkpoint (laneserve: `families.lfm2.loader.load_model`; for reference, mlx-lm:
`mlx_lm.utils.load_model`), and reads the peak again, with MLX's own peak (`mx.get_peak_memory`:
what MLX allocated, on the GPU too). The report divides the peaks by the total size of
the *.safetensors files. The aim for a bf16 checkpoint is a peak RSS within 1.3x the
file size: loading never holds two copies of the weights.

On a CUDA machine the weights live in device memory, so the RSS ratio says little
there; MLX's peak is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from bench.provenance import markdown_line, provenance, write_result

LOADERS = ("laneserve", "mlx-lm")


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def child(model: str, loader: str, dtype: str | None) -> None:
    """Runs in the subprocess: load once, print one JSON line of measurements."""
    import mlx.core as mx

    if loader == "laneserve":
        from families.lfm2.loader import load_model
    else:
        from mlx_lm.utils import load_model as mlx_lm_load_model
    baseline = peak_rss_bytes()
    mx.reset_peak_memory()
    if loader == "laneserve":
        load_model(model, dtype)
    else:
        mlx_lm_load_model(Path(model))  # the weights only, evaluated (not lazy)
    print(json.dumps({
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "mlx_peak": mx.get_peak_memory(),
        "mlx_active": mx.get_active_memory(),
        "device": str(mx.default_device()),
    }))


def measure(model: str, loader: str, dtype: str | None) -> dict:
    command = [sys.executable, "-m", "bench.bench_load_memory", "--model", model, "--child", loader]
    if dtype:
        command += ["--dtype", dtype]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    gb = 1e9
    size = result["file_bytes"]
    lines = [
        f"# Load memory: {Path(result['model']).name}",
        "",
        markdown_line(result),
        f"- weights: {size / gb:.2f} GB of *.safetensors; dtype {result['dtype']}",
        "- peak RSS includes the baseline (Python, MLX and the loader imported, before loading)",
        "",
        "| loader | baseline RSS GB | peak RSS GB | peak RSS / files | (peak - baseline) / files | MLX peak GB | MLX peak / files |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result["loads"].items():
        lines.append(
            f"| {name} | {r['baseline_rss'] / gb:.2f} | {r['peak_rss'] / gb:.2f} | {r['peak_rss'] / size:.2f}x | "
            f"{(r['peak_rss'] - r['baseline_rss']) / size:.2f}x | {r['mlx_peak'] / gb:.2f} | {r['mlx_peak'] / size:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--out", help="results directory (NAME.json and NAME.md)")
    parser.add_argument("--name", help="base name of the result files (default: load-memory-<model dir name>)")
    parser.add_argument("--loaders", default="laneserve,mlx-lm", help=f"comma-separated, from {LOADERS}")
    parser.add_argument("--dtype", help="laneserve's cast at load (default: as stored)")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, args.dtype)
        return

    from families.lfm2.loader import safetensors_files

    record = provenance()
    loads = {loader: measure(args.model, loader, args.dtype) for loader in args.loaders.split(",")}
    result = {
        **record,
        "model": args.model,
        "dtype": args.dtype or "as stored",
        "file_bytes": sum(f.stat().st_size for f in safetensors_files(Path(args.model))),
        "loads": loads,
    }
    print(markdown(result))
    if args.out:
        name = args.name or f"load-memory-{Path(args.model).name}"
        write_result(args.out, name, result, markdown(result))


if __name__ == "__main__":
    main()

"""Where a result came from: the command that wrote it, the commit it ran, the machine.

Every bench script that writes a result file puts `provenance()`'s fields first in its
JSON and `markdown_line(...)` at the head of its markdown, so that each figure in
bench/results names a run anyone can repeat. Take it once, when a run starts:
a script that rewrites its files as it goes keeps the record of the run it is.

- command: as typed, `python -m bench.X ARGS` (or `python PATH ARGS` for a script run by
  path), with PYTHONPATH in front where it adds folders of this repository (an earlier
  commit's package imported beside the current one, as `bench_step --families` does).
  Environment that changes only speed, such as LD_PRELOAD of OpenBLAS, is left out of the
  command and noted under machine.
- commit: `git rev-parse --short HEAD` of this repository, `-dirty` when tracked files
  outside bench/results differ from it (result files do not change what runs). Where the
  tree is not a git checkout (a copy sent to another machine), BENCH_COMMIT names it;
  an explicit BENCH_COMMIT also wins over git, whose metadata in such a copy can be stale.
  Otherwise "unknown".
- machine: OS, architecture, CPU count and MLX's default device, with the accelerator's
  name and memory where MLX reports them, and the MLX_* settings in the environment
  (families/backend.py gives some defaults; any may change speed).
- mlx: MLX's version; date: when the run started, UTC.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = "bench/results"


def command_line(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command that started this process: `python -m MODULE ARGS`. `module` defaults
    to the one run with `-m`; `argv` to sys.argv[1:] (pass both when a script's main is
    called with its own argument list)."""
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else None
    head = ["python", "-m", module] if module else ["python", _relative(sys.argv[0])]
    args = sys.argv[1:] if argv is None else list(argv)
    paths = [_relative(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if _in_repo(p)]
    env = [f"PYTHONPATH={os.pathsep.join(paths)}"] if paths else []
    return shlex.join([*env, *head, *args])


def _in_repo(path: str) -> bool:
    """A PYTHONPATH entry inside this repository other than its root (which every run has)."""
    if not path:
        return False
    resolved = Path(path).resolve()
    return resolved != REPO and resolved.is_relative_to(REPO)


def _relative(path: str) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else path


def commit() -> str:
    """HEAD's short hash, `-dirty` when tracked code differs; see the module docstring."""
    named = os.environ.get("BENCH_COMMIT")
    if named:
        return named
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS}"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout; set BENCH_COMMIT)"
    return head + ("-dirty" if changed else "")


def machine() -> str:
    """OS, architecture, CPUs and the MLX device, e.g. 'Linux x86_64, 16 CPUs; gpu: NVIDIA H200, 140.4 GB'."""
    described = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    if "openblas" in os.environ.get("LD_PRELOAD", "").lower():
        described += ", OpenBLAS preloaded"
    try:
        import mlx.core as mx
    except ImportError:  # an HTTP client (bench_concurrent) needs no MLX
        return described + "; no MLX"
    device = mx.default_device()
    kind = "gpu" if device.type == mx.gpu else "cpu"
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 -- any backend failure: the record must never stop a benchmark
        info = {}
    accelerator = ", ".join(filter(None, [
        str(info.get("device_name", "")).strip(),
        f"{info['memory_size'] / 1e9:.1f} GB" if isinstance(info.get("memory_size"), (int, float)) else "",
    ]))
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MLX_"))
    return f"{described}; {kind}" + (f": {accelerator}" if accelerator else "") + (f"; {settings}" if settings else "")


def provenance(argv: list[str] | None = None, module: str | None = None) -> dict:
    """command, commit, machine, mlx and date of this run (see the module docstring)."""
    return {
        "command": command_line(argv, module),
        "commit": commit(),
        "machine": machine(),
        "mlx": mlx_version(),
        "date": datetime.now(UTC).replace(microsecond=0).isoformat(),
    }


def mlx_version() -> str:
    try:
        import mlx.core as mx
    except ImportError:
        return "none"
    return mx.__version__  # also where MLX is unpacked beside the project, not installed


def markdown_line(record: dict) -> str:
    """One markdown line for a result file's head: the command, then where and when it ran.
    (A record from before this module names what it lacks.)"""
    field = lambda key: record.get(key, f"{key} not recorded")
    return (f"- command: `{field('command')}` at commit {field('commit')}; {field('machine')}; "
            f"mlx {field('mlx')}; {field('date')}")


def spread(values: list[float]) -> dict:
    """A figure over alternations as every result reports it: median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_range(summary: dict, digits: int = 2, unit: str = "", *, scale: float = 1.0, percent: bool = False) -> str:
    """A `spread` as the reports print it, "MEDIAN [MIN-MAX]": each figure times `scale` with
    `digits` decimals (as a percentage with `percent`), `unit` after the median only.
    {"median": 1.234, "min": 1.1, "max": 1.4} with unit "x" gives "1.23x [1.10-1.40]"."""
    kind = "%" if percent else "f"
    figure = lambda key: f"{summary[key] * scale:.{digits}{kind}}"
    return f"{figure('median')}{unit} [{figure('min')}-{figure('max')}]"


def write_result(out: str | Path, name: str, result: dict, markdown: str) -> None:
    """A run's files: NAME.json (the result, provenance first) and NAME.md (its report)
    under `out`, made if missing."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)

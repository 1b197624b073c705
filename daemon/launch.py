"""The `laneserve` console script's first step, before MLX is imported.

MLX's CPU wheel for Linux ships a slow reference BLAS: float32 matmul runs 10-30x faster
with Debian's OpenBLAS preloaded, and the embedded default warms up in about 4 s instead
of about a minute on a 2-core x86 machine. Where that OpenBLAS is installed and not yet
preloaded, the process re-executes itself once with it in LD_PRELOAD (the same process:
exec keeps the PID, so launchd and systemd see no change). `LANESERVE_NO_PRELOAD=1` keeps
the process as it is.
"""

from __future__ import annotations

import os
import platform
import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"


def preload_environment(environ: dict[str, str], system: str, machine: str, installed: bool) -> dict[str, str] | None:
    """The environment to re-execute with, or None to go on as is."""
    if system != "Linux" or machine != "x86_64" or not installed or environ.get("LANESERVE_NO_PRELOAD"):
        return None
    preloaded = environ.get("LD_PRELOAD", "")
    if OPENBLAS in preloaded.replace(":", " ").split():
        return None
    return {**environ, "LD_PRELOAD": f"{OPENBLAS}:{preloaded}" if preloaded else OPENBLAS}


def main() -> None:
    environ = preload_environment(dict(os.environ), platform.system(), platform.machine(), os.path.exists(OPENBLAS))
    if environ is not None:
        os.execve(sys.executable, [sys.executable, "-m", "daemon.cli", *sys.argv[1:]], environ)
    from daemon.cli import entry  # MLX loads here, after the preload decision

    entry()

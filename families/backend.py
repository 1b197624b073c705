"""MLX's CUDA backend, set up for a long-lived server.

The backend reads a few settings from the environment when it first runs. Importing
`families` gives the ones below defaults (a value already in the environment wins), so
every entry point (the daemon, `generate`, the trainers, the benchmarks) runs with them.
Other backends ignore them.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

BACKEND_DEFAULTS = {
    # MLX's CUDA caches (graph executables by topology, cuDNN attention and convolution
    # plans by shape) are LRUs that raise "Cache thrashing is happening" once their
    # misses over the process's whole life pass twice their capacity. A server meets new
    # shapes and topologies for as long as it runs (prompt lengths, lane counts, verify
    # widths), so that fuse would end it one day mid-request; evicting is all it needs.
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    # Kernels launched one by one rather than recorded into CUDA graphs: on an H100 at 16
    # lanes drafted rounds ran 1.18x as fast without graphs in two runs side by side,
    # plain rounds 0.97x and 1.06x; at one lane 0.97x plain and 1.01x drafted
    # (bench/results/gpu/session33/). A drafted round is several short evaluations, each
    # recorded into graphs before it runs, which is where the time likely went (a reading
    # of the backend, not profiled).
    "MLX_USE_CUDA_GRAPHS": "0",
}


def apply_backend_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put each of BACKEND_DEFAULTS into `environ` unless it is already there; returns
    the ones it set."""
    applied = {name: value for name, value in BACKEND_DEFAULTS.items() if name not in environ}
    environ.update(applied)
    return applied

"""The lane core's debug log (every round and every guard decision) written to a file, as
the engine benchmarks' `--log FILE` asks."""

from __future__ import annotations

import logging
import os


def write_lane_core_log(path: str) -> None:
    """Log to `path` (its folder made if missing: it is often the run's --out, which the
    benchmark would make only later), each line stamped with its time as `laneserve serve`
    stamps it, so `bench.round_phases` gives each round's interval as it does a server's."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    lanes_log = logging.getLogger("laneserve")
    lanes_log.addHandler(handler)
    lanes_log.setLevel(logging.DEBUG)

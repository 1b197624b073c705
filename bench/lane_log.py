"""The lane core's debug log (every round and every guard decision) written to a file, as
the engine benchmarks' `--log FILE` asks."""

from __future__ import annotations

import logging


def write_lane_core_log(path: str) -> None:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(relativeCreated)d %(name)s %(message)s"))
    lanes_log = logging.getLogger("laneserve")
    lanes_log.addHandler(handler)
    lanes_log.setLevel(logging.DEBUG)

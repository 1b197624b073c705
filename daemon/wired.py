"""Wired memory on Metal: keep the weights and KV pools resident while serving.

macOS may page out GPU buffers that are not wired; a served model that gets paged out
stalls every stream. At startup the daemon wires what it needs (target and drafter
weights, their KV pools at the serving context for every lane, plus headroom), never
more than the device's recommended working set, and puts the previous limit back on exit.
When the need comes near that working set, the log says how to raise it with
`sudo sysctl iogpu.wired_limit_mb=N`, or what to shrink when no setting could hold it.

The arithmetic is pure and tested anywhere; only `wire_for_serving` touches MLX.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

MIB = 1 << 20
GIB = 1 << 30
# Round activations, logits and a KV pool's copy while it grows sit on top of the pools.
HEADROOM_PERCENT = 10
# Warn from here: past it the rest of the system and MLX's own buffers compete for what is left.
NEAR = 0.90
# What a raised system limit must still leave to macOS and other processes.
OS_RESERVE_FRACTION = 1 / 8
OS_RESERVE_MIN = 4 * GIB


def bytes_needed(weights: int, drafter_weights: int, kv_bytes_per_position: int, positions: int,
                 headroom_percent: int = HEADROOM_PERCENT) -> int:
    """Resident bytes for serving: every lane's KV at `positions` tokens, weights, headroom.
    `kv_bytes_per_position` covers all lanes of all pools (target and drafter)."""
    resident = weights + drafter_weights + kv_bytes_per_position * positions
    return resident + -(-resident * headroom_percent // 100)


def wireable_ceiling(memory: int) -> int:
    """The most a raised system wired limit should take of `memory`."""
    return memory - max(OS_RESERVE_MIN, math.ceil(memory * OS_RESERVE_FRACTION))


@dataclass(frozen=True)
class WiredPlan:
    needed: int
    recommended: int  # the device's max recommended working set (the system wired limit)
    memory: int  # the device's memory size

    @property
    def limit(self) -> int:
        """What to wire: the need, capped at the recommended working set (MLX refuses more)."""
        return min(self.needed, self.recommended)

    @property
    def near_limit(self) -> bool:
        return self.needed >= NEAR * self.recommended

    @property
    def sysctl_mb(self) -> int | None:
        """A system wired limit (MB, whole GiB) under which the need is no longer near the
        limit, held below what macOS must keep; None where no setting can hold the need."""
        ceiling_mb = wireable_ceiling(self.memory) // MIB
        wanted_mb = math.ceil(self.needed / NEAR / GIB) * 1024
        if self.needed > ceiling_mb * MIB:
            return None
        return min(wanted_mb, ceiling_mb)

    def warning(self) -> str | None:
        if not self.near_limit:
            return None
        head = (f"serving needs {self.needed // MIB} MB resident, near the recommended working set "
                f"of {self.recommended // MIB} MB: streams may stall while macOS pages weights out")
        if self.sysctl_mb is not None and self.sysctl_mb * MIB > self.recommended:
            return f"{head}; raise it with `sudo sysctl iogpu.wired_limit_mb={self.sysctl_mb}` (until reboot)"
        return (f"{head}, and this Mac ({self.memory // MIB} MB) cannot wire more: lower --max-model-len "
                f"or --max-streams, or serve a smaller or quantized model")


def weight_bytes(module) -> int:
    return sum(array.nbytes for _, array in tree_flatten(module.parameters()))


def kv_bytes_per_position(pools) -> int:
    return sum(pool.nbytes_per_position() for pool in pools)


def wire_for_serving(target, drafter, positions: int, log: logging.Logger) -> Callable[[], None]:
    """On Metal, wire what serving `positions` tokens per lane needs and return a callable
    that restores the previous limit (call it once the engine thread has stopped). Elsewhere
    there is nothing to wire and the callable does nothing."""
    if not mx.metal.is_available():
        return lambda: None
    pools = list(target.kv.values()) + (list(drafter.kv) if drafter is not None else [])
    needed = bytes_needed(
        weight_bytes(target.model), weight_bytes(drafter.model) if drafter is not None else 0,
        kv_bytes_per_position(pools), positions,
    )
    info = mx.device_info()
    plan = WiredPlan(needed, info["max_recommended_working_set_size"], info["memory_size"])
    previous = mx.set_wired_limit(plan.limit)
    log.info("wired limit %d MB for %d MB needed (recommended working set %d MB); was %d MB",
             plan.limit // MIB, plan.needed // MIB, plan.recommended // MIB, previous // MIB)
    warning = plan.warning()
    if warning:
        log.warning(warning)

    def restore() -> None:
        mx.set_wired_limit(previous)
        log.info("wired limit restored to %d MB", previous // MIB)

    return restore

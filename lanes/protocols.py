"""What the lane core needs from a model family, named: a target that runs ragged rounds
and commits them, and a drafter that proposes blocks with confidences.

`families/lfm2` implements both (`Lfm2Target`, `DSparkDrafter`); a second family is one
new folder implementing them. The lane core holds a lane's caches only as opaque
handles (`LaneCache`) and reads nothing of a forward's output but what is named here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx


class LaneCache(Protocol):
    """A lane's place in a model's caches."""

    length: int  # tokens committed (target) or rows of context (drafter)


@dataclass(frozen=True)
class DeviceLengths:
    """Lanes' committed lengths as the device holds them, after a round whose kept rows
    the host has not read: `lengths [N]` int32 (lane order) and a host upper bound on
    each. A round built on them runs while the host reads the one before."""

    lengths: mx.array
    bounds: tuple[int, ...]


class RoundOutput(Protocol):
    """One forward's lazily evaluated results, rows packed in the order lanes were given."""

    logits: mx.array  # [rows, V]
    taps: mx.array | None  # [rows, n_taps * H]: the residuals a drafter reads
    row_starts: list[int]  # first packed row of each lane
    widths: list[int]  # rows each lane fed


class Target(Protocol):
    max_lanes: int
    vocab_size: int
    context_limit: int

    def open_lane(self) -> LaneCache: ...
    def close_lane(self, lane: LaneCache) -> None: ...

    def forward(self, lanes: list[LaneCache], tokens: list[list[int]] | mx.array, *, logits: str = "all",
                taps: tuple[int, ...] = (), key_bucket: int = 1, widths: list[int] | None = None,
                at: DeviceLengths | None = None, steady: bool = False) -> RoundOutput:
        """Lane i feeds `tokens[i]` at its next positions (or, given a lazy packed array,
        `widths[i]` rows each, one by default; `at`: from lengths only the device knows;
        `steady`: host tokens padded to a steady width, rows past each lane's own never
        kept); nothing is kept until `commit` (or `keep`, then `count`)."""

    def commit(self, output: RoundOutput, kept: list[int]) -> None:
        """Keep the first `kept[i]` rows of lane i; drop the rest."""

    def keep(self, output: RoundOutput, kept: list[int] | mx.array) -> None:
        """The device's half of `commit`: the caches as they are after the kept rows,
        `kept` possibly an array the host has not read."""

    def count(self, output: RoundOutput, kept: list[int]) -> None:
        """The host's half of `commit`, once the kept rows are read: the lanes' lengths."""

    def state_arrays(self) -> list[mx.array]:
        """Every cache array, to evaluate a round's writes with its outputs."""

    def plans_per_shape(self) -> bool:
        """Whether the backend builds a plan per new shape (rounds then pad to steady shapes)."""

    def runs_behind_host(self) -> bool:
        """Whether the device evaluates launched work while the host goes on (rounds may then overlap)."""

    def row_bucket(self, rows: int, ceiling: int | None = None) -> int:
        """The steady row count `rows` pads to where shapes are kept steady."""

    def chunk_bucket(self, rows: int) -> int:
        """The steady width a prompt chunk of `rows` rows pads to (`forward(steady=True)`)."""

    def kv_bytes(self) -> int: ...
    def kv_bytes_in_use(self) -> int: ...

    # The prefix cache's view: a prefix's rows copied out, and restored into a fresh lane.
    boundary_every: int  # positions at whose multiples each lane keeps its conv states (0: none)

    def prefix_rows(self, lane: LaneCache, start: int, end: int) -> tuple[mx.array, ...]:
        """Copies of what positions start..end-1 of a lane hold, with the state after end-1."""

    def restore_prefix(self, lane: LaneCache, *rows: mx.array) -> None:
        """Start a fresh lane as if it had read a prefix whose `prefix_rows` these are."""


class Proposal(Protocol):
    tokens: mx.array  # [N, g] drafts
    confidences: mx.array | None  # [N, g] chance each survives given the ones before it did

    def arrays(self) -> list[mx.array]:
        """What to evaluate together before reading the proposal."""


Pick = Callable[[mx.array, int], mx.array]  # (chain logits [N, V] of block row k, k) -> tokens [N]


class Drafter(Protocol):
    tap_layers: tuple[int, ...]  # the target layers whose residuals it reads
    width: int  # default proposals per round

    def open_lane(self) -> LaneCache: ...
    def close_lane(self, lane: LaneCache) -> None: ...

    def append(self, lanes: list[LaneCache], taps: list[mx.array] | mx.array, tokens: list[list[int]],
               bucket_rows: bool = False) -> None:
        """Add newly committed rows (their taps, per lane or every lane's in one array,
        and token ids) to each lane's context."""

    def append_window(self, lanes: list[LaneCache], taps: mx.array, width: int, at: DeviceLengths) -> None:
        """Add each lane's `width` rows of a verify round (its taps, lane after lane) at
        its device-held length, before the host knows how many it kept."""

    def landed(self, lanes: list[LaneCache], tokens: list[list[int]]) -> None:
        """The committed tokens of the rows `append_window` added, once read: the lanes'
        contexts grow by them."""

    def propose(self, lanes: list[LaneCache], anchors: list[int] | mx.array, width: int | None = None, pick: Pick | None = None,
                *, chain_logits: bool = True, confidences: bool = True, at: DeviceLengths | None = None) -> Proposal:
        """Draft `width` tokens after each lane's anchor, all lanes in one lazy forward
        (`chain_logits=False`: without the chain's [N, g, V] logits; `confidences=False`:
        the caller will not read the confidences, which may then be None; anchors as an
        array and `at`: the device's, after a round the host has not read)."""

    def validate(self, proposal: Proposal) -> list[Exception | None]:
        """Per lane: None when its drafts may be verified, else the error that makes its round plain."""

    def state_arrays(self) -> list[mx.array]: ...
    def kv_bytes(self) -> int: ...
    def kv_bytes_in_use(self) -> int: ...

    def context_rows(self, lane: LaneCache, start: int, end: int) -> tuple[mx.array, ...]:
        """Copies of a lane's context at positions start..end-1."""

    def restore_context(self, lane: LaneCache, tokens: list[int], *rows: mx.array) -> None:
        """Start a fresh lane's context from the `context_rows` of `tokens` read before."""

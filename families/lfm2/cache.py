"""Per-lane caches held in slot pools, and the layout of a ragged round.

Every lane owns one slot. A pool keeps one layer's state for all slots in one array, so a
round reads and writes every lane's state with one gather/scatter per layer instead of
one op per lane. Attention keys are stored at their absolute positions, so rolling a
lane back is only a shorter committed length: rows past it are never attended (the
causal mask compares positions) and are overwritten by the next round.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from . import cuda


def plans_per_shape() -> bool:
    """Whether the default device's backend builds a plan the first time it meets each
    matmul shape (CUDA's cuBLASLt does: about 3.5 ms per shape on the H200). Where it
    does, rounds pad their varying row counts to `row_bucket`s; elsewhere padding would
    only add work."""
    return cuda.available()


def row_bucket(rows: int, ceiling: int | None = None) -> int:
    """`rows` rounded up to a power of two (at most `ceiling`, when given, if rows fit it).

    Where the backend plans per shape, rounds whose row counts vary (verify windows,
    drafter context appends) pad to these buckets, so a handful of shapes pay for their
    plans once where every row count would pay again."""
    bucket = 1 << max(rows - 1, 0).bit_length()
    return min(bucket, ceiling) if ceiling is not None and rows <= ceiling else bucket


def chunk_bucket(rows: int) -> int:
    """The steady width a prompt chunk of `rows` rows pads to: a power of two up to 64,
    then a multiple of 64 (a prompt's last chunk is any length up to the engine's chunk,
    and a power of two past 64 would nearly double the widest ones' work)."""
    return row_bucket(rows) if rows <= 64 else -(-rows // 64) * 64


class Traces:
    """Compiled functions by spec: `traces(spec)` is `mx.compile(build(spec))`, traced on
    first use. The spec holds everything about a call that is not an array (a value read
    from Python inside a trace is baked into it silently), so each spec gets its own
    function; the least recently used are dropped past `limit`."""

    def __init__(self, build, limit: int = 128):
        self.build, self.limit = build, limit
        self._compiled: OrderedDict = OrderedDict()

    def __call__(self, spec):
        if spec in self._compiled:
            self._compiled.move_to_end(spec)
        else:
            self._compiled[spec] = mx.compile(self.build(spec))
            if len(self._compiled) > self.limit:
                self._compiled.popitem(last=False)
        return self._compiled[spec]

    def specs(self) -> list:
        return list(self._compiled)


class RaggedLayout:
    """Where each lane's rows sit in a round.

    Rows travel packed (`[R, ...]`, lane after lane, no padding) through every per-row
    layer, and padded (`[N, W, ...]`, W the widest lane) through the layers that mix
    rows in time (conv, attention). Padding rows follow a lane's real rows, so causal
    operators never let them reach a real row.
    """

    def __init__(self, widths: list[int], offsets: list[int] | None, key_bucket: int = 1, *,
                 offsets_array: mx.array | None = None, reach: int | None = None, own_width: int | None = None):
        """`offsets` are each lane's first position, as host ints. Where only the device
        knows them (`offsets_array`: a compiled segment's traced offsets, or lengths a
        round in flight has not reported), `reach` bounds the furthest row any lane
        reaches, for the key span; a compiled segment attends no keys (no span).
        `own_width`: the most rows a lane brought, where rows were padded to `widths` (a
        steady prompt read); the attention path goes by it."""
        if not widths or min(widths) < 1:
            raise ValueError(f"every lane in a round needs at least one row, got widths {widths}")
        self.widths = list(widths)
        self.offsets = None if offsets is None else list(offsets)
        self.lanes = len(widths)
        self.width = max(widths)
        self.own_width = self.width if own_width is None else own_width
        self.rows = sum(widths)
        self.uniform = min(widths) == self.width
        self.row_starts = [0]
        for w in widths[:-1]:
            self.row_starts.append(self.row_starts[-1] + w)
        self.offsets_array = mx.array(self.offsets, dtype=mx.int32) if offsets_array is None else offsets_array
        # Key span the round's attention reads: the furthest row any lane reaches,
        # rounded up to `key_bucket` (keys past a lane's rows are masked). Rounding keeps
        # attention shapes steady from round to round, so a backend that builds kernels
        # or plans per shape builds them once per bucket, not once per round.
        if offsets is not None:
            reach = max(o + self.width for o in self.offsets)
        self.span = None if reach is None else -(-reach // key_bucket) * key_bucket
        # Index arrays and masks every layer of the round shares, built once.
        self._shared: dict = {}
        if not self.uniform:
            pad_index, unpad_index = [], []
            for i, (start, w) in enumerate(zip(self.row_starts, widths)):
                pad_index += [start + min(j, w - 1) for j in range(self.width)]
                unpad_index += [i * self.width + j for j in range(w)]
            self._pad_index = mx.array(pad_index, dtype=mx.int32)
            self._unpad_index = mx.array(unpad_index, dtype=mx.int32)

    def pad(self, x: mx.array) -> mx.array:
        """[R, ...] packed rows -> [N, W, ...]."""
        if not self.uniform:
            x = x[self._pad_index]
        return x.reshape(self.lanes, self.width, *x.shape[1:])

    def unpad(self, x: mx.array) -> mx.array:
        """[N, W, ...] -> [R, ...] packed rows."""
        x = x.reshape(self.lanes * self.width, *x.shape[2:])
        return x if self.uniform else x[self._unpad_index]

    def positions(self) -> mx.array:
        """[N, W] absolute position of every padded row."""
        return self.offsets_array[:, None] + mx.arange(self.width, dtype=mx.int32)[None, :]

    def shared(self, key, build):
        """`build()`, once per round for each key: layers reuse what the first one built."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def rope_offset(self) -> int | mx.array:
        """RoPE's offset: the lane's position as an int for one lane known on the host,
        else every lane's as an array."""
        return self.offsets[0] if self.lanes == 1 and self.offsets is not None else self.offsets_array

    def slot_index(self, slots: list[int] | mx.array) -> slice | mx.array:
        """How to index a pool by these slots: a slice when they are contiguous (a view,
        and an in-place update), else an index array (a gather, a scatter). A compiled
        round passes the slots of a non-contiguous set as an array."""
        if isinstance(slots, mx.array):
            return slots
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            return slice(first, first + len(slots))
        return self.slot_ids(slots)

    def slot_ids(self, slots: list[int] | mx.array) -> mx.array:
        """The slots as an int32 array `[N]`."""
        if isinstance(slots, mx.array):
            return slots
        return self.shared(("slots", tuple(slots)), lambda: mx.array(slots, dtype=mx.int32))

    def attention_mask(self, keys: int) -> mx.array | None:
        """[N, 1, W, keys] boolean: row j of lane i sees keys at positions <= offset_i + j.
        None where plain causal alignment already says the same."""
        if self.lanes == 1 and self.offsets is not None and self.offsets[0] + self.width == keys:
            return None if self.width == 1 else "causal"
        return self.shared(
            ("causal", keys),
            lambda: (mx.arange(keys, dtype=mx.int32)[None, None, :] <= self.positions()[:, :, None])[:, None],
        )


@dataclass
class LaneSlot:
    """A lane's place in a model's caches: its slot and how many tokens it has committed.
    `conv_at` keeps the conv states at block boundaries the lane has passed (boundary ->
    `[conv layers, L-1, H]`), where a prefix cache asks for them: a conv state is only
    known at the position it was computed for."""

    slot: int
    length: int = 0
    conv_at: dict[int, mx.array] = field(default_factory=dict)


class DeviceLengths(Protocol):
    """Lanes' committed lengths as the device holds them, where a round the host has not
    read yet decided how many rows each lane kept: `lengths [N]` (int32, in the order the
    lanes are given) and a host upper bound on each, which sizes the key span and the
    pools. (The lane core passes its own dataclass of this shape.)"""

    lengths: mx.array
    bounds: tuple[int, ...]


class KVPool:
    """One attention layer's keys and values for every slot, `[S, kv_heads, capacity, D]`.

    Stored flat as `[S * kv_heads * capacity, D]` so a round's rows, each at its own
    slot and position, are written with one scatter that updates the pool in place."""

    STEP = 256

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype):
        self.slots, self.kv_heads, self.head_dim, self.dtype = slots, kv_heads, head_dim, dtype
        self.capacity = 0
        self.keys = mx.zeros((0, head_dim), dtype=dtype)
        self.values = mx.zeros((0, head_dim), dtype=dtype)

    def _shaped(self, flat: mx.array) -> mx.array:
        return flat.reshape(self.slots, self.kv_heads, self.capacity, self.head_dim)

    def reserve(self, positions: int) -> None:
        """Grow so every slot can hold `positions` rows. Growth is geometric (by a
        quarter at least), so reading a long prompt copies the pool a bounded number
        of times instead of once per step."""
        if positions <= self.capacity:
            return
        wanted = max(positions, self.capacity + self.capacity // 4)
        new_capacity = -(-wanted // self.STEP) * self.STEP
        grow = mx.zeros((self.slots, self.kv_heads, new_capacity - self.capacity, self.head_dim), self.dtype)
        keys = mx.concatenate([self._shaped(self.keys), grow], axis=2) if self.capacity else grow
        values = mx.concatenate([self._shaped(self.values), grow], axis=2) if self.capacity else grow
        self.capacity = new_capacity
        self.keys = keys.reshape(-1, self.head_dim)
        self.values = values.reshape(-1, self.head_dim)

    def shrink(self, positions: int) -> None:
        """Give memory back once no slot needs more than `positions` rows (0: none open),
        to within a step of that. The copy is left to the next evaluation: waiting for it
        here would wait for the round in flight too."""
        new_capacity = -(-positions // self.STEP) * self.STEP
        if new_capacity >= self.capacity:
            return
        if new_capacity == 0:
            self.keys = mx.zeros((0, self.head_dim), dtype=self.dtype)
            self.values = mx.zeros((0, self.head_dim), dtype=self.dtype)
        else:
            self.keys = mx.contiguous(self._shaped(self.keys)[:, :, :new_capacity]).reshape(-1, self.head_dim)
            self.values = mx.contiguous(self._shaped(self.values)[:, :, :new_capacity]).reshape(-1, self.head_dim)
        self.capacity = new_capacity

    def holding(self, keys: mx.array, values: mx.array) -> KVPool:
        """A pool of this geometry over other arrays: a compiled round writes and reads
        its traced inputs through one, then returns what it holds."""
        pool = copy.copy(self)
        pool.keys, pool.values = keys, values
        pool.capacity = keys.shape[0] // (self.slots * self.kv_heads)
        return pool

    def write(self, slots: list[int] | mx.array, layout: RaggedLayout, keys: mx.array, values: mx.array) -> None:
        """Store `[N, kv_heads, W, D]` rows at their lanes' slots and positions."""
        rows = layout.shared(
            ("kv rows", self.kv_heads, self.capacity),
            lambda: (layout.slot_ids(slots)[:, None, None] * self.kv_heads + mx.arange(self.kv_heads)[None, :, None])
            * self.capacity
            + layout.positions()[:, None, :],
        )
        self.keys[rows] = keys.astype(self.dtype)
        self.values[rows] = values.astype(self.dtype)

    def read(self, slots: list[int], layout: RaggedLayout) -> tuple[mx.array, mx.array]:
        """Keys and values `[N, kv_heads, span, D]` of the given slots."""
        index, span = layout.slot_index(slots), layout.span
        return self._shaped(self.keys)[index, :, :span], self._shaped(self.values)[index, :, :span]

    def views(self) -> tuple[mx.array, mx.array]:
        """Every slot's keys and values `[S, kv_heads, capacity, D]` (views)."""
        return self._shaped(self.keys), self._shaped(self.values)

    def rows(self, slot: int, start: int, end: int) -> tuple[mx.array, mx.array]:
        """One slot's keys and values at positions start..end-1, `[kv_heads, n, D]` (lazy views)."""
        return self._shaped(self.keys)[slot, :, start:end], self._shaped(self.values)[slot, :, start:end]

    def put(self, slot: int, keys: mx.array, values: mx.array) -> None:
        """Store `[kv_heads, n, D]` rows at one slot's positions 0..n-1 (a restored prefix)."""
        n = keys.shape[1]
        self.reserve(n)
        heads = mx.arange(self.kv_heads, dtype=mx.int32)[:, None]
        index = (slot * self.kv_heads + heads) * self.capacity + mx.arange(n, dtype=mx.int32)[None, :]
        self.keys[index] = keys.astype(self.dtype)
        self.values[index] = values.astype(self.dtype)

    def nbytes_per_position(self) -> int:
        return 2 * self.slots * self.kv_heads * self.head_dim * self.dtype.size


def stacked_rows(pools: list[KVPool], slot: int, start: int, end: int) -> tuple[mx.array, mx.array]:
    """Copies of one slot's keys and values at positions start..end-1 in every pool,
    `[pools, kv_heads, n, D]` each (lazy)."""
    rows = [pool.rows(slot, start, end) for pool in pools]
    return mx.stack([k for k, _ in rows]), mx.stack([v for _, v in rows])


def put_stacked_rows(pools: list[KVPool], slot: int, keys: mx.array, values: mx.array) -> None:
    """Store `stacked_rows` at one slot's positions 0..n-1, pool by pool."""
    for pool, k, v in zip(pools, keys, values, strict=True):
        pool.put(slot, k, v)


class SlotAllocator:
    """Hands out the slots of a model's pools and takes them back. When a lane leaves,
    the KV pools shrink to what the lanes left will ask for, so memory returns to its
    idle level once every lane has gone."""

    def __init__(self, slots: int, pools: list[KVPool], owner: str):
        self.slots = slots
        self.pools = pools
        self.owner = owner
        self._open: dict[int, LaneSlot] = {}

    def open(self) -> LaneSlot:
        free = [s for s in range(self.slots) if s not in self._open]
        if not free:
            raise RuntimeError(f"all {self.slots} {self.owner} lane slots are in use")
        lane = LaneSlot(free[0])
        self._open[lane.slot] = lane
        return lane

    def committed_tokens(self) -> int:
        """Tokens held by the open lanes, all together."""
        return sum(lane.length for lane in self._open.values())

    def close(self, lane: LaneSlot) -> None:
        if self._open.get(lane.slot) is not lane:
            raise RuntimeError(f"{self.owner} lane slot {lane.slot} is not open")
        del self._open[lane.slot]
        lane.length = 0
        lane.conv_at.clear()
        longest = max((other.length for other in self._open.values()), default=0)
        # The lanes left ask for their rows and a step more: a round's key span rounds up
        # to a bucket of up to a step (KEY_BUCKET), its rows in flight beyond. Shrunk to
        # the rows alone, the pools grew back at the next round, and as lanes ended one by
        # one (a batch's tail, short replies in service) each end copied every pool twice.
        for pool in self.pools:
            pool.shrink(longest + KVPool.STEP if longest else 0)


class ConvPool:
    """One conv layer's last `L-1` rows of `u` for every slot, `[S, L-1, H]`."""

    def __init__(self, slots: int, rows: int, hidden: int, dtype):
        self.state = mx.zeros((slots, rows, hidden), dtype=dtype)

    def holding(self, state: mx.array) -> ConvPool:
        """A pool over another state array (see KVPool.holding)."""
        pool = copy.copy(self)
        pool.state = state
        return pool

    def read(self, slots: list[int], layout: RaggedLayout) -> mx.array:
        return self.state[layout.slot_index(slots)]

    def write(self, slots: list[int], layout: RaggedLayout, rows: mx.array) -> None:
        self.state[layout.slot_index(slots)] = rows.astype(self.state.dtype)

    def clear(self, slot: int) -> None:
        self.state[slot] = mx.zeros(self.state.shape[1:], self.state.dtype)

"""The LFM2 target as the lane core sees it: lanes with caches, ragged rounds, commit.

A round is one forward over every lane's rows; nothing about a lane's conv state changes
until `commit` is told how many of its rows were kept, so a partial accept costs no
recomputation: KV rows past the kept prefix are simply not counted, and each conv state
is rebuilt from the inputs the forward recorded.

Rounds whose lanes all feed the same few rows (decode steps, padded verify windows) run
as one compiled function (`mx.compile`): the caches go in and come out as arrays, and
every per-round value (offsets, slot ids, tokens) is an array argument, so one trace
serves every round of the same shape. What is not an array (the widths, the key span,
contiguous slots, the lane order, the taps) is the trace's `RoundSpec`: a value read
from Python inside a trace would be baked into it silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import ConvPool, KVPool, LaneSlot, RaggedLayout, SlotAllocator, Traces, plans_per_shape, row_bucket, traced_key_span
from .config import Lfm2Config
from .model import SMALL_QUERY, Lfm2Model



class ContextLimitError(ValueError):
    """A lane would grow past the model's context limit."""


@dataclass
class RoundRecord:
    """What commit needs from a forward: the lanes in slot order, each conv layer's input
    window (the state before the round followed by the round's `u` rows) and, for a
    one-row round, each conv pool as it is once every lane keeps its row."""

    lanes: list[LaneSlot]  # slot order
    order: list[int]  # caller index of each lane in slot order
    layout: RaggedLayout
    conv_windows: dict[int, mx.array]
    conv_kept: dict[int, mx.array]  # one-row rounds: layer -> its pool with every row kept
    conv_version: int  # the conv pools' version the forward read


@dataclass(frozen=True)
class RoundSpec:
    """Everything about a compiled round that is not an array: rounds with the same spec
    share a trace."""

    widths: tuple[int, ...]  # rows per lane, slot order
    span: int  # keys attended
    slots: tuple[int, ...] | None  # contiguous slots (read as views), else None: slot ids come as an array
    order: tuple[int, ...]  # caller index of each lane in slot order
    taps: tuple[int, ...]
    last_only: bool  # logits for each lane's last row only


@dataclass
class RoundOutput:
    """A round's lazily evaluated results, rows packed in the order lanes were given."""

    logits: mx.array | None  # [rows, V] for the requested rows
    taps: mx.array | None  # [rows, n_taps * H], the residual after each tap layer, concatenated
    row_starts: list[int]  # first packed row of each lane
    widths: list[int]
    record: RoundRecord


class Lfm2Target:
    def __init__(self, model: Lfm2Model, config: Lfm2Config, max_lanes: int = 16, compiled: bool = True):
        """`compiled`: run uniform rounds of few rows as compiled functions (see above)."""
        self.model = model
        self.compiled = compiled
        self._conv_version = 0  # counts changes to the conv pools (see commit)
        self._traces = Traces(self._traced_round)
        model.merge_projections()
        self.config = config
        self.max_lanes = max_lanes
        self.dtype = model.embed_tokens.weight.dtype if hasattr(model.embed_tokens, "weight") else mx.float16
        if self.dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized table: use its scales' type
            self.dtype = model.embed_tokens.scales.dtype
        cfg = config
        self.kv = {i: KVPool(max_lanes, cfg.num_kv_heads, cfg.head_dim, self.dtype) for i in cfg.attention_layers}
        self.conv = {i: ConvPool(max_lanes, cfg.conv_kernel - 1, cfg.hidden_size, self.dtype) for i in cfg.conv_layers}
        self.slots = SlotAllocator(max_lanes, list(self.kv.values()), "target")
        # Materialise the pools now: an array built lazily on one thread cannot be
        # evaluated on another, and the engine thread may not be this one.
        mx.eval(self.state_arrays())

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def context_limit(self) -> int:
        return self.config.max_position

    def open_lane(self) -> LaneSlot:
        lane = self.slots.open()
        self._conv_version += 1
        for pool in self.conv.values():
            pool.clear(lane.slot)
        return lane

    def close_lane(self, lane: LaneSlot) -> None:
        self.slots.close(lane)

    def kv_bytes(self) -> int:
        return sum(pool.capacity * pool.nbytes_per_position() for pool in self.kv.values())

    @staticmethod
    def plans_per_shape() -> bool:
        """Whether this backend builds a plan per new shape, so rounds should pad varying
        row counts and key spans to a few steady shapes (see cache.plans_per_shape)."""
        return plans_per_shape()

    @staticmethod
    def row_bucket(rows: int, ceiling: int | None = None) -> int:
        """The steady row count that `rows` pads to (see cache.row_bucket)."""
        return row_bucket(rows, ceiling)

    def kv_bytes_in_use(self) -> int:
        """Bytes of KV the open lanes' committed tokens occupy (`kv_bytes` is what is reserved)."""
        per_token = sum(pool.nbytes_per_position() for pool in self.kv.values()) // self.max_lanes
        return per_token * self.slots.committed_tokens()

    def forward(
        self,
        lanes: list[LaneSlot],
        tokens: list[list[int]],
        *,
        logits: str = "all",
        taps: tuple[int, ...] = (),
        key_bucket: int = 1,
    ) -> RoundOutput:
        """One ragged forward: lane i feeds `tokens[i]` at positions `length_i ...`.
        `tokens` may also be a lazy `[N]` array, one row per lane (a plain round fed with
        the previous round's unread choices). `logits` is "all" (every row) or "last"
        (each lane's last row); `taps` are the layers whose residuals a drafter reads;
        `key_bucket` rounds the attention's key span up (see RaggedLayout)."""
        lazy = isinstance(tokens, mx.array)
        widths = [1] * len(lanes) if lazy else [len(t) for t in tokens]
        offsets = [lane.length for lane in lanes]
        furthest = max(o + w for o, w in zip(offsets, widths))
        if furthest > self.context_limit:
            raise ContextLimitError(f"a lane would reach {furthest} tokens, past the context limit {self.context_limit}")
        # Lanes run in slot order so contiguous slots are read as slices, not gathers.
        order = sorted(range(len(lanes)), key=lambda i: lanes[i].slot)
        widths_sorted, offsets_sorted = [widths[i] for i in order], [offsets[i] for i in order]
        slots = [lanes[i].slot for i in order]
        compile_round = self.compiled and len(set(widths)) == 1 and widths[0] <= SMALL_QUERY
        span = traced_key_span(offsets_sorted, widths[0], key_bucket) if compile_round else None
        layout = RaggedLayout(widths_sorted, offsets_sorted, key_bucket, span=span)
        for pool in self.kv.values():
            pool.reserve(layout.span)
        if lazy:
            packed = tokens if order == sorted(order) else tokens[mx.array(order)]
            packed = packed.astype(mx.int32)
        else:
            packed = mx.array([t for i in order for t in tokens[i]], dtype=mx.int32)
        last_only = logits == "last"
        state = [a for pool in self.kv.values() for a in (pool.keys, pool.values)] + [pool.state for pool in self.conv.values()]
        if compile_round:
            contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
            spec = RoundSpec(tuple(widths_sorted), layout.span, tuple(slots) if contiguous else None, tuple(order), taps, last_only)
            slot_ids = [] if contiguous else [layout.slot_ids(slots)]
            outputs = self._traces(spec)(packed, layout.offsets_array, *slot_ids, *state)
        else:
            outputs = self._round(layout, slots, order, taps, last_only, packed, state)
        out_logits, out_taps, kv_state, windows, conv_after = self._unflatten(outputs, bool(taps))
        for pool, (keys, values) in zip(self.kv.values(), kv_state):
            pool.keys, pool.values = keys, values
        conv_kept = dict(zip(self.conv, conv_after))
        row_starts, position = [], 0
        for w in widths:
            row_starts.append(position)
            position += w
        record = RoundRecord([lanes[i] for i in order], order, layout, windows, conv_kept, self._conv_version)
        return RoundOutput(out_logits, out_taps, row_starts, widths, record)

    def _traced_round(self, spec: RoundSpec):
        """`_round` for one spec, as a function of arrays only (what `mx.compile` traces)."""

        def round_fn(packed, offsets, *arrays):
            layout = RaggedLayout(list(spec.widths), None, offsets_array=offsets, span=spec.span)
            slots = list(spec.slots) if spec.slots is not None else arrays[0]
            state = arrays if spec.slots is not None else arrays[1:]
            return self._round(layout, slots, list(spec.order), spec.taps, spec.last_only, packed, state)

        return round_fn

    def _round(self, layout: RaggedLayout, slots, order: list[int], taps: tuple[int, ...], last_only: bool,
               packed: mx.array, state: list[mx.array]) -> list[mx.array]:
        """A round as a function of arrays (eager or traced): packed tokens (slot order)
        and the cache arrays in; logits and taps (caller order), the cache arrays after
        the round's KV writes, each conv layer's window and, for one-row rounds, each conv
        pool once the rows are kept, out (flat, see `_unflatten`)."""
        kv_arrays = state[: 2 * len(self.kv)]
        kv = {i: pool.holding(*kv_arrays[2 * j : 2 * j + 2]) for j, (i, pool) in enumerate(self.kv.items())}
        conv = {i: pool.holding(s) for (i, pool), s in zip(self.conv.items(), state[2 * len(self.kv) :])}
        h, tapped, windows = self.model.ragged(packed, layout, slots, kv, conv, taps)
        widths = [0] * len(order)
        for i, w in zip(order, layout.widths):
            widths[i] = w
        if order != sorted(order):  # back to the caller's lane order
            sorted_starts = dict(zip(order, layout.row_starts))
            caller_rows = mx.array([sorted_starts[i] + j for i in range(len(order)) for j in range(widths[i])], dtype=mx.int32)
            h = h[caller_rows]
            tapped = [t[caller_rows] for t in tapped]
        if last_only:
            ends = [sum(widths[: i + 1]) - 1 for i in range(len(widths))]
            h = h[mx.array(ends, dtype=mx.int32)]
        outputs = [self.model.head(h)]
        if tapped:
            outputs.append(mx.concatenate(tapped, axis=-1))
        outputs += [a for pool in kv.values() for a in (pool.keys, pool.values)]
        outputs += [windows[i] for i in self.conv]
        if layout.width == 1:
            span = self.config.conv_kernel - 1
            for i, pool in conv.items():
                pool.write(slots, layout, windows[i][:, -span:])
            outputs += [pool.state for pool in conv.values()]
        return outputs

    def _unflatten(self, outputs: list[mx.array], tapped: bool):
        """`_round`'s flat outputs -> logits, taps, KV pairs, conv windows, conv pools after."""
        outputs = list(outputs)
        logits = outputs.pop(0)
        taps = outputs.pop(0) if tapped else None
        kv = [(outputs[2 * j], outputs[2 * j + 1]) for j in range(len(self.kv))]
        outputs = outputs[2 * len(self.kv) :]
        windows = dict(zip(self.conv, outputs[: len(self.conv)]))
        return logits, taps, kv, windows, outputs[len(self.conv) :]

    def commit(self, output: RoundOutput, kept: list[int]) -> None:
        """Keep the first `kept[i]` rows of lane i (caller order); drop the rest."""
        record = output.record
        kept_sorted = [kept[i] for i in record.order]
        for lane, k, w in zip(record.lanes, kept_sorted, record.layout.widths):
            if not 1 <= k <= w:
                raise ValueError(f"a lane keeps {k} of {w} rows; it must keep between 1 and all")
            lane.length += k
        self._conv_version += 1
        if record.conv_kept and record.conv_version == self._conv_version - 1:
            # A one-row round, committed before any other change to the conv pools: its
            # forward already built each pool with every row kept.
            for i, state in record.conv_kept.items():
                self.conv[i].state = state
            return
        span = self.config.conv_kernel - 1
        if record.conv_windows:
            if all(k == record.layout.width for k in kept_sorted):
                pick = None
            else:
                # The state after keeping k rows: window rows k .. k + L-2.
                pick = (mx.array(kept_sorted, dtype=mx.int32)[:, None] + mx.arange(span, dtype=mx.int32))[:, :, None]
            slots = [lane.slot for lane in record.lanes]
            for i, window in record.conv_windows.items():
                state = window[:, -span:] if pick is None else mx.take_along_axis(window, pick, axis=1)
                self.conv[i].write(slots, record.layout, state)

    def prefill(self, lane: LaneSlot, tokens: list[int], chunk: int = 512, taps: tuple[int, ...] = ()):
        """Read a prompt in chunks; returns the last row's logits `[V]` and, with `taps`
        (layer ids), every prompt row's residuals after them `[len(tokens), n_taps * H]`."""
        tapped = []
        logits = None
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            out = self.forward([lane], [part], logits="last", taps=taps)
            self.commit(out, [len(part)])
            logits = out.logits[0]
            if taps:
                tapped.append(out.taps)
            mx.eval(logits, *tapped, *self.state_arrays())
        return logits, (mx.concatenate(tapped, axis=0) if taps else None)

    def state_arrays(self) -> list[mx.array]:
        """Every pool array, for evaluating a round's cache writes together with its outputs."""
        arrays = []
        for pool in self.kv.values():
            arrays += [pool.keys, pool.values]
        arrays += [pool.state for pool in self.conv.values()]
        return arrays

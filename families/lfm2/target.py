"""The LFM2 target as the lane core sees it: lanes with caches, ragged rounds, commit.

A round is one forward over every lane's rows; nothing about a lane's conv state changes
until `commit` is told how many of its rows were kept, so a partial accept costs no
recomputation: KV rows past the kept prefix are simply not counted, and each conv state
is rebuilt from the inputs the forward recorded.

Rounds whose lanes all feed the same few rows (decode steps, padded verify windows) and
steady prompt reads (every lane padded to one of a few chunk widths) run their layers as
compiled functions (`mx.compile`), one per segment between attention cores: the conv
states go in and come out as arrays and every per-round value (offsets, slot ids,
tokens) is an array argument, so one trace serves every round of the same shape. What
is not an array (the segment, the widths, contiguous slots, the taps) is the trace's
`SegmentSpec`: a value read from Python inside a trace would be baked into it
silently. The attention cores (KV writes and attention over each lane's keys) run
between the segments as they do eagerly, so a key span that grows with the context
never asks for a new trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import conv_kernel
from .cache import (
    ConvPool,
    DeviceLengths,
    KVPool,
    LaneSlot,
    RaggedLayout,
    SlotAllocator,
    Traces,
    chunk_bucket,
    plans_per_shape,
    put_stacked_rows,
    row_bucket,
    stacked_rows,
)
from .config import Lfm2Config
from .model import SMALL_QUERY, Lfm2Model


def in_slot_order(values: mx.array, order: list[int]) -> mx.array:
    """Per-lane `values` given in the caller's order, in slot order (`order[j]`: the
    caller's index of the j-th lane by slot); no gather where the orders agree."""
    return values if order == sorted(order) else values[mx.array(order, dtype=mx.int32)]


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
class SegmentSpec:
    """Everything about a compiled segment of a round that is not an array: segments
    with the same spec share a trace."""

    segment: int  # between attention cores segment-1 and segment (see Lfm2Model.segment)
    widths: tuple[int, ...]  # rows per lane, slot order
    slots: tuple[int, ...] | None  # slots 0..N-1 (read as views), else None: slot ids come as an array
    taps: tuple[int, ...]


@dataclass
class RoundOutput:
    """A round's lazily evaluated results, rows packed in the order lanes were given."""

    logits: mx.array | None  # [rows, V] for the requested rows
    taps: mx.array | None  # [rows, n_taps * H], the residual after each tap layer, concatenated
    row_starts: list[int]  # first packed row of each lane
    widths: list[int]
    record: RoundRecord


class Lfm2Target:
    def __init__(self, model: Lfm2Model, config: Lfm2Config, max_lanes: int = 16, compiled: bool = True,
                 by_rows: bool | None = None):
        """`compiled`: run uniform rounds of few rows and steady prompt reads as compiled
        functions (see above).
        `by_rows`: multiply a few rows by the weights without cuBLASLt
        (model.row_products), and by a MoE's experts without gather_mm
        (model.Experts); None: where the backend plans per shape (CUDA)."""
        self.model = model
        self.compiled = compiled
        self._conv_version = 0  # counts changes to the conv pools (see commit)
        self._traces = Traces(self._traced_segment, limit=4096)  # segments x lane counts x widths x taps x slot views
        model.merge_projections()
        if plans_per_shape() if by_rows is None else by_rows:
            model.serve_by_rows()
        self.config = config
        self.max_lanes = max_lanes
        # Positions at whose multiples each lane keeps its conv state (0: none); a prefix
        # cache sets it to its block size.
        self.boundary_every = 0
        self._recorded: list[mx.array] = []  # conv states at boundaries, not yet handed to an evaluation
        self.dtype = model.embed_tokens.weight.dtype if hasattr(model.embed_tokens, "weight") else mx.float16
        if self.dtype not in (mx.float32, mx.float16, mx.bfloat16):  # quantized table: use its scales' type
            self.dtype = model.embed_tokens.scales.dtype
        cfg = config
        self.kv = {i: KVPool(max_lanes, cfg.num_kv_heads, cfg.head_dim, self.dtype) for i in cfg.attention_layers}
        self.conv = {i: ConvPool(max_lanes, cfg.conv_kernel - 1, cfg.hidden_size, self.dtype) for i in cfg.conv_layers}
        self.slots = SlotAllocator(max_lanes, list(self.kv.values()), "target")
        self._segment_convs = [[i for i in model.segment_layers(j) if i in self.conv] for j in range(len(cfg.attention_layers) + 1)]
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
    def runs_behind_host() -> bool:
        """Whether the device evaluates what the host launched while the host goes on (a
        GPU's queue), so a round built while another runs costs no wait. On the CPU
        `async_eval` hands the graph to a thread of its own, which computes on the host's
        cores; overlapped drafted rounds ran slower there than rounds in step."""
        return mx.default_device().type == mx.DeviceType.gpu

    def steady_width(self, widths: list[int], bounds: list[int]) -> int | None:
        """The one width lanes feeding `widths` rows at `bounds` pad to in a steady forward
        (`forward(steady=True)`), or None where they stay as they are: where padding
        would more than double the rows (a long prompt's chunk beside short ones), or
        reach past the context limit. On a backend that plans each matmul shape once
        (CUDA's cuBLASLt, about 3.5 ms a shape on the H200), chunks of the lengths
        prompts come in would meet a new shape at nearly every read, and in service
        every decoding lane's round waits on a joining lane's read."""
        width = chunk_bucket(max(widths))
        if width * len(widths) > 2 * sum(widths) or max(bounds) + width > self.context_limit:
            return None
        return width

    @staticmethod
    def chunk_bucket(rows: int) -> int:
        """The steady width a prompt chunk of `rows` rows pads to (see cache.chunk_bucket)."""
        return chunk_bucket(rows)

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
        widths: list[int] | None = None,
        at: DeviceLengths | None = None,
        steady: bool = False,
    ) -> RoundOutput:
        """One ragged forward: lane i feeds `tokens[i]` at positions `length_i ...`.
        `tokens` may also be a lazy array of the packed rows, lane after lane, lane i
        feeding `widths[i]` rows (one each by default): a round fed with choices or drafts
        the host has not read. `logits` is "all" (every row) or "last" (each lane's last
        row); `taps` are the layers whose residuals a drafter reads; `key_bucket` rounds
        the attention's key span up (see RaggedLayout). `at`: the lanes' lengths as the
        device holds them, where a round in flight has not reported what it kept (the
        rows then go at `at.lengths[i] ...`; `keep` such a round, then `count` it once
        read). `steady` (host tokens): pad every lane's rows to one steady width
        (`steady_width`), rows past a lane's own computed and never kept, so prompt chunks
        of any lengths meet a few shapes; "last" still means each lane's last own row."""
        lazy = isinstance(tokens, mx.array)
        if not lazy:
            widths = [len(t) for t in tokens]
        elif widths is None:
            widths = [1] * len(lanes)
        bounds = [lane.length for lane in lanes] if at is None else list(at.bounds)
        furthest = max(b + w for b, w in zip(bounds, widths))
        if furthest > self.context_limit:
            raise ContextLimitError(f"a lane would reach {furthest} tokens, past the context limit {self.context_limit}")
        own, padded = widths, False
        if steady and not lazy and (width := self.steady_width(widths, bounds)) is not None:
            tokens = [t + [t[-1]] * (width - len(t)) for t in tokens]
            widths, padded = [width] * len(lanes), True
        # Lanes run in slot order so contiguous slots are read as slices, not gathers.
        order = sorted(range(len(lanes)), key=lambda i: lanes[i].slot)
        slots = [lanes[i].slot for i in order]
        if at is None:
            layout = RaggedLayout([widths[i] for i in order], [bounds[i] for i in order], key_bucket, own_width=max(own))
        else:
            layout = RaggedLayout([widths[i] for i in order], None, key_bucket, offsets_array=in_slot_order(at.lengths, order),
                                  reach=furthest)
        for pool in self.kv.values():
            pool.reserve(layout.span)
        row_starts, position = [], 0
        for w in widths:
            row_starts.append(position)
            position += w
        if lazy:
            packed = tokens
            if order != sorted(order):  # the rows in slot order
                packed = tokens[mx.array([row_starts[i] + r for i in order for r in range(widths[i])], dtype=mx.int32)]
            packed = packed.astype(mx.int32)
        else:
            packed = mx.array([t for i in order for t in tokens[i]], dtype=mx.int32)
        # A steady read's widths come from a few buckets, so its traces recur as a round's
        # do; eager, a joining lane's read of a chat prompt issued about half again as
        # many kernels as compiled, each launched by the host while the decoding lanes wait.
        compiled = self.compiled and len(set(widths)) == 1 and (widths[0] <= SMALL_QUERY or padded)
        h, tapped, windows, conv_kept = self._layers(packed, layout, slots, taps, compiled)
        if order != sorted(order):  # back to the caller's lane order
            sorted_starts = dict(zip(order, layout.row_starts))
            caller_rows = mx.array([sorted_starts[i] + r for i in range(len(lanes)) for r in range(widths[i])], dtype=mx.int32)
            h = h[caller_rows]
            tapped = [t[caller_rows] for t in tapped]
        if logits == "last":
            h = h[mx.array([s + w - 1 for s, w in zip(row_starts, own)], dtype=mx.int32)]
        out_taps = mx.concatenate(tapped, axis=-1) if tapped else None
        record = RoundRecord([lanes[i] for i in order], order, layout, windows, conv_kept, self._conv_version)
        return RoundOutput(self.model.head(h), out_taps, row_starts, widths, record)

    def _layers(self, packed: mx.array, layout: RaggedLayout, slots: list[int], taps: tuple[int, ...], compiled: bool):
        """Every layer over the round's packed rows (slot order), segment by segment with
        the attention cores between them -> residual rows, tap residuals, conv windows,
        conv pools with the row kept (one-row rounds)."""
        # Slots 0..N-1 are read as views; any other set by ids (an array). Lanes come and
        # go, so a view of slots s..s+N-1 would be a trace per s: only s = 0 gets one.
        contiguous = slots == list(range(len(slots)))
        slot_ids = [] if contiguous else [layout.slot_ids(slots)]
        h, attended, tapped, windows, conv_kept = packed, None, [], {}, {}
        for j, convs in enumerate(self._segment_convs):
            args = [h, *([attended] if j else []), layout.offsets_array, *slot_ids, *(self.conv[i].state for i in convs)]
            if compiled:
                spec = SegmentSpec(j, tuple(layout.widths), tuple(slots) if contiguous else None, taps)
                outputs = self._traces(spec)(*args)
            else:
                outputs = self._segment_arrays(j, layout, slots, taps, *args)
            h, qkv, seg_tapped, seg_windows, seg_kept = self._unflatten(j, outputs, taps, layout.width == 1)
            tapped += seg_tapped
            windows.update(seg_windows)
            conv_kept.update(seg_kept)
            if qkv is not None:
                i = self.config.attention_layers[j]
                attended = self.model.layers[i].self_attn.core(*qkv, layout, slots, self.kv[i])
        return h, tapped, windows, conv_kept

    def _traced_segment(self, spec: SegmentSpec):
        """`_segment_arrays` for one spec, as a function of arrays only (what `mx.compile` traces)."""

        def segment_fn(*args):
            offsets = args[2 if spec.segment else 1]
            layout = RaggedLayout(list(spec.widths), None, offsets_array=offsets)
            slots = list(spec.slots) if spec.slots is not None else args[3 if spec.segment else 2]
            return self._segment_arrays(spec.segment, layout, slots, spec.taps, *args)

        return segment_fn

    def _segment_arrays(self, j: int, layout: RaggedLayout, slots, taps: tuple[int, ...], *args: mx.array) -> list[mx.array]:
        """Segment j of a round (see Lfm2Model.segment) as a function of arrays, eager or
        traced. In: the packed tokens (j = 0) or residual rows, core j-1's output (j > 0),
        the offsets, the slot ids (non-contiguous slots), the segment's conv pools. Out
        (flat, see `_unflatten`): residual rows, q, k, v for core j, the tap residuals,
        the conv windows and, for one-row rounds, the conv pools with the row kept."""
        x, attended = args[0], (args[1] if j else None)
        convs = self._segment_convs[j]
        states = args[len(args) - len(convs) :]
        conv = {i: self.conv[i].holding(state) for i, state in zip(convs, states)}
        h = self.model.embed_tokens(x) if j == 0 else x
        one_row = layout.width == 1
        h, qkv, tapped, windows = self.model.segment(j, h, attended, layout, slots, conv, taps, keep=one_row)
        outputs = [h, *(qkv or ()), *tapped, *(windows[i] for i in convs)]
        return outputs + [conv[i].state for i in convs] if one_row else outputs

    def _unflatten(self, j: int, outputs: list[mx.array], taps: tuple[int, ...], one_row: bool):
        """`_segment_arrays`' flat outputs -> residual rows, (q, k, v) or None, tap
        residuals, conv windows, conv pools with the row kept."""
        outputs = list(outputs)
        h = outputs.pop(0)
        qkv = None
        if j < len(self.config.attention_layers):
            qkv, outputs = tuple(outputs[:3]), outputs[3:]
        tapped_count = sum(1 for i in self.model.segment_layers(j) if i in taps)
        tapped, outputs = outputs[:tapped_count], outputs[tapped_count:]
        convs = self._segment_convs[j]
        windows = dict(zip(convs, outputs[: len(convs)]))
        kept = dict(zip(convs, outputs[len(convs) :])) if one_row else {}
        return h, qkv, tapped, windows, kept

    def commit(self, output: RoundOutput, kept: list[int]) -> None:
        """Keep the first `kept[i]` rows of lane i (caller order); drop the rest."""
        record = output.record
        for lane, k, w in zip(record.lanes, (kept[i] for i in record.order), record.layout.widths):
            if not 1 <= k <= w:
                raise ValueError(f"a lane keeps {k} of {w} rows; it must keep between 1 and all")
        self.keep(output, kept)
        self.count(output, kept)

    def keep(self, output: RoundOutput, kept: list[int] | mx.array) -> None:
        """The device's half of `commit`: each conv state as it is after lane i's first
        `kept[i]` rows (caller order). `kept` may be an array the host has not read, each
        count within 1..the lane's rows; `count` the round once it is."""
        record = output.record
        self._conv_version += 1
        on_host = None if isinstance(kept, mx.array) else [kept[i] for i in record.order]  # slot order
        if record.conv_kept and record.conv_version == self._conv_version - 1:
            # A one-row round, kept before any other change to the conv pools: its
            # forward already built each pool with every row kept.
            for i, state in record.conv_kept.items():
                self.conv[i].state = state
            return
        span = self.config.conv_kernel - 1
        layers = list(record.conv_windows)
        kept_array = mx.array(on_host, dtype=mx.int32) if on_host is not None else in_slot_order(kept, record.order).astype(mx.int32)
        if layers and all(self.model.layers[i].conv.by_kernel for i in layers):
            states = conv_kernel.kept_states([record.conv_windows[i] for i in layers], [self.conv[i].state for i in layers],
                                             record.layout.slot_ids([lane.slot for lane in record.lanes]), kept_array)
            for i, state in zip(layers, states):
                self.conv[i].state = state
        elif layers:
            if on_host is not None and all(k == record.layout.width for k in on_host):
                pick = None
            else:
                # The state after keeping k rows: window rows k .. k + L-2.
                pick = (kept_array[:, None] + mx.arange(span, dtype=mx.int32))[:, :, None]
            slots = [lane.slot for lane in record.lanes]
            for i, window in record.conv_windows.items():
                state = window[:, -span:] if pick is None else mx.take_along_axis(window, pick, axis=1)
                self.conv[i].write(slots, record.layout, state)

    def count(self, output: RoundOutput, kept: list[int]) -> None:
        """The host's half of `commit`: each lane's length grows by the rows it kept (and
        its conv states at the block boundaries they cross are recorded)."""
        record = output.record
        kept_sorted = [kept[i] for i in record.order]
        if self.boundary_every:
            self._record_boundaries(record, kept_sorted)
        for lane, k in zip(record.lanes, kept_sorted):
            lane.length += k

    def _record_boundaries(self, record: RoundRecord, kept: list[int]) -> None:
        """Keep each lane's conv states at the block boundaries its kept rows cross: after
        keeping k rows a conv state is window rows k .. k + L-2. They are copies, handed
        out by the next `state_arrays` to be evaluated with the round, so the round's
        windows are not held past its evaluation and no launch of their own is paid."""
        span, every = self.config.conv_kernel - 1, self.boundary_every
        for row, (lane, k) in enumerate(zip(record.lanes, kept)):
            for boundary in range(-(-(lane.length + 1) // every) * every, lane.length + k + 1, every):
                rows = boundary - lane.length
                windows = [record.conv_windows[i][row, rows : rows + span] for i in self.config.conv_layers]
                state = mx.stack(windows) if windows else mx.zeros((0, span, self.config.hidden_size), self.dtype)
                lane.conv_at[boundary] = state
                self._recorded.append(state)

    def prefix_rows(self, lane: LaneSlot, start: int, end: int) -> tuple[mx.array, mx.array, mx.array]:
        """Copies of what a lane holds for positions start..end-1: keys and values
        `[attention layers, kv_heads, n, D]` and the conv states after position end-1
        `[conv layers, L-1, H]` (lazy). `end` must be a boundary the lane recorded."""
        if end not in lane.conv_at:
            raise KeyError(f"no conv state was recorded at position {end} of slot {lane.slot}")
        return *stacked_rows(list(self.kv.values()), lane.slot, start, end), lane.conv_at[end]

    def restore_prefix(self, lane: LaneSlot, keys: mx.array, values: mx.array, conv: mx.array) -> None:
        """Start a fresh lane from a prefix of n tokens read before (see `prefix_rows`):
        its K/V rows at positions 0..n-1 and the conv states after position n-1."""
        if lane.length:
            raise ValueError(f"slot {lane.slot} already holds {lane.length} tokens; a prefix restores into a fresh lane only")
        n = keys.shape[2]
        put_stacked_rows(list(self.kv.values()), lane.slot, keys, values)
        for j, i in enumerate(self.config.conv_layers):
            self.conv[i].state[lane.slot] = conv[j].astype(self.dtype)
        self._conv_version += 1
        lane.length = n
        lane.conv_at[n] = conv

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
        """Every pool array, and the conv states lanes recorded at block boundaries since
        the last call: what to evaluate with a round's outputs."""
        arrays = []
        for pool in self.kv.values():
            arrays += [pool.keys, pool.values]
        arrays += [pool.state for pool in self.conv.values()]
        arrays += self._recorded
        self._recorded = []
        return arrays

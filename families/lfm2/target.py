"""The LFM2 target as the lane core sees it: lanes with caches, ragged rounds, commit.

A round is one forward over every lane's rows; nothing about a lane's conv state changes
until `commit` is told how many of its rows were kept, so a partial accept costs no
recomputation: KV rows past the kept prefix are simply not counted, and each conv state
is rebuilt from the inputs the forward recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .cache import ConvPool, KVPool, LaneSlot, RaggedLayout, SlotAllocator
from .config import Lfm2Config
from .model import Lfm2Model


class ContextLimitError(ValueError):
    """A lane would grow past the model's context limit."""


@dataclass
class RoundRecord:
    """What commit needs from a forward: the lanes in slot order and each conv layer's
    input window (the state before the round followed by the round's `u` rows)."""

    lanes: list[LaneSlot]  # slot order
    order: list[int]  # caller index of each lane in slot order
    layout: RaggedLayout
    conv_windows: dict[int, mx.array]


@dataclass
class RoundOutput:
    """A round's lazily evaluated results, rows packed in the order lanes were given."""

    logits: mx.array | None  # [rows, V] for the requested rows
    taps: mx.array | None  # [rows, n_taps * H], the residual after each tap layer, concatenated
    row_starts: list[int]  # first packed row of each lane
    widths: list[int]
    record: RoundRecord


class Lfm2Target:
    def __init__(self, model: Lfm2Model, config: Lfm2Config, max_lanes: int = 16):
        self.model = model
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
        for pool in self.conv.values():
            pool.clear(lane.slot)
        return lane

    def close_lane(self, lane: LaneSlot) -> None:
        self.slots.close(lane)

    def kv_bytes(self) -> int:
        return sum(pool.capacity * pool.nbytes_per_position() for pool in self.kv.values())

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
        layout = RaggedLayout([widths[i] for i in order], [offsets[i] for i in order], key_bucket)
        for pool in self.kv.values():
            pool.reserve(layout.span)
        identity = order == sorted(order)
        if lazy:
            packed = tokens.astype(mx.int32) if identity else tokens[mx.array(order)].astype(mx.int32)
        else:
            packed = mx.array([t for i in order for t in tokens[i]], dtype=mx.int32)
        slots = [lanes[i].slot for i in order]
        h, tapped, windows = self.model.ragged(packed, layout, slots, self.kv, self.conv, taps)
        # Back to the caller's lane order.
        sorted_starts = dict(zip(order, layout.row_starts))
        row_starts, position = [], 0
        for i in range(len(lanes)):
            row_starts.append(position)
            position += widths[i]
        if not identity:
            caller_rows = mx.array([sorted_starts[i] + j for i in range(len(lanes)) for j in range(widths[i])], dtype=mx.int32)
            h = h[caller_rows]
        if logits == "last":
            last = mx.array([s + w - 1 for s, w in zip(row_starts, widths)], dtype=mx.int32)
            out_logits = self.model.head(h[last])
        else:
            out_logits = self.model.head(h)
        out_taps = None
        if tapped:
            out_taps = mx.concatenate(tapped, axis=-1)
            if not identity:
                out_taps = out_taps[caller_rows]
        record = RoundRecord([lanes[i] for i in order], order, layout, windows)
        return RoundOutput(out_logits, out_taps, row_starts, widths, record)

    def commit(self, output: RoundOutput, kept: list[int]) -> None:
        """Keep the first `kept[i]` rows of lane i (caller order); drop the rest."""
        record = output.record
        kept_sorted = [kept[i] for i in record.order]
        for lane, k, w in zip(record.lanes, kept_sorted, record.layout.widths):
            if not 1 <= k <= w:
                raise ValueError(f"a lane keeps {k} of {w} rows; it must keep between 1 and all")
            lane.length += k
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

"""The drafter serving many lanes (`DSparkDrafter`): each lane's context K/V in slot pools,
appended only with committed rows, and one batched, compiled proposal for all lanes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .. import attention_kernel, cuda, heads_kernel, residual_kernel
from ..cache import (
    DeviceLengths,
    KVPool,
    LaneSlot,
    RaggedLayout,
    SlotAllocator,
    Traces,
    plans_per_shape,
    put_stacked_rows,
    row_bucket,
    stacked_rows,
)
from ..model import Lfm2Model, serve_linears_by_rows
from .chain import FusedGreedyChain
from .model import DSparkModel

# Proposals round their key span up to this many rows (see RaggedLayout).
KEY_BUCKET = 256


class DraftError(RuntimeError):
    """A lane's round of proposals is unusable (non-finite numbers or an id outside the
    vocabulary); the round fails for that lane only."""

    def __init__(self, lane: int, reasons: list[str]):
        self.lane = lane
        self.reasons = reasons
        super().__init__(f"draft for lane {lane} is unusable: {'; '.join(reasons)}")


NONFINITE_LOGITS, NONFINITE_CONFIDENCE, ID_OUT_OF_RANGE = 1, 2, 4


@dataclass(frozen=True)
class ProposalSegment:
    """Everything about a compiled segment of a proposal that is not an array: segments
    with the same spec share a trace (see target.SegmentSpec)."""

    segment: int  # between the attention cores of block layers segment-1 and segment
    lanes: int
    width: int  # g
    greedy: bool  # the argmax chain runs in the last segment (a pick runs it on the host's terms)
    chain_logits: bool
    confidences: bool


@dataclass
class Proposal:
    """One round's drafts for N lanes, lazily evaluated, lanes in the order given.

    Block row k proposes `tokens[:, k]` (x_{k+1}, the token after x_k, x_0 the anchor),
    picked from `logits[:, k]`; `confidences[:, k]` is the chance that `tokens[:, k]`
    survives verification given that `tokens[:, :k]` did (None without a confidence
    head). `faults` is a per-lane bitmask read by `validate_proposal`."""

    tokens: mx.array  # [N, g] int32
    confidences: mx.array | None  # [N, g] float32
    logits: mx.array | None  # [N, g, V] float32, the Markov-corrected chain logits l_k (None when not asked for)
    faults: mx.array  # [N] int32
    vocab_size: int

    def arrays(self) -> list[mx.array]:
        """What to evaluate (together, in one sync) before reading the proposal."""
        return [a for a in (self.tokens, self.confidences, self.logits, self.faults) if a is not None]


def draft_faults(tokens: mx.array, confidences: mx.array | None, logits: mx.array, vocab_size: int) -> mx.array:
    """Per-lane fault bitmask [N] (lazy): non-finite logits, non-finite confidences, ids
    outside [0, vocab_size). Without the chain logits, `logits` may be the block's final
    hidden rows `[N, g, H]`: with the finite weights load insists on, the logits are
    finite exactly when those rows are (the final norm bounds them)."""
    faults = mx.where(mx.isfinite(logits).all(axis=(1, 2)), 0, NONFINITE_LOGITS)
    if confidences is not None:
        faults = faults | mx.where(mx.isfinite(confidences).all(axis=1), 0, NONFINITE_CONFIDENCE)
    outside = ((tokens < 0) | (tokens >= vocab_size)).any(axis=1)
    return (faults | mx.where(outside, ID_OUT_OF_RANGE, 0)).astype(mx.int32)


def validate_proposal(proposal: Proposal) -> list[DraftError | None]:
    """One entry per lane: None when its drafts may be verified, else the DraftError
    that fails its round. Never raises, so one bad lane leaves the others drafting.
    Reads `faults` (a host sync unless the proposal's arrays were evaluated)."""
    faults = proposal.faults.tolist()
    errors: list[DraftError | None] = []
    for lane, fault in enumerate(faults):
        reasons = []
        if fault & NONFINITE_LOGITS:
            reasons.append("the chain logits hold NaN or Inf")
        if fault & NONFINITE_CONFIDENCE:
            reasons.append("the confidences hold NaN or Inf")
        if fault & ID_OUT_OF_RANGE:
            reasons.append(f"a draft id lies outside [0, {proposal.vocab_size})")
        errors.append(DraftError(lane, reasons) if reasons else None)
    return errors


Pick = Callable[[mx.array, int], mx.array]


class DSparkDrafter:
    """A drafter serving many lanes: each lane owns a slot of append-only context K/V.

    A lane's context holds one row per committed token of its sequence (the taps of
    that token's target row), at that token's position; its length must equal the
    target's committed length. `propose` never grows it."""

    def __init__(self, model: DSparkModel, target_model: Lfm2Model, max_lanes: int = 16, compiled: bool = True,
                 by_rows: bool | None = None):
        """`compiled`: context appends and proposals run as compiled functions, one trace
        per shape (see target.py). `by_rows`: a few rows times the weights without cuBLASLt
        (see families.lfm2.model.row_products); None: where the
        backend plans per shape (CUDA). On CUDA a greedy proposal's chain runs as one
        kernel (`chain.FusedGreedyChain`, where the Markov head is unquantized; set
        `fused_chain` to None before the first proposal to run it as operations)."""
        self.model = model
        self.config = model.config
        self.embed = target_model.embed_tokens  # borrowed: embeds the block and is the head
        self.tied_logits = target_model.tied_logits
        self.max_lanes = max_lanes
        self.dtype = model.hidden_norm.weight.dtype
        cfg = self.config
        self.kv = [KVPool(max_lanes, cfg.num_kv_heads, cfg.head_dim, self.dtype) for _ in range(cfg.num_layers)]
        self.slots = SlotAllocator(max_lanes, self.kv, "drafter")
        for layer in model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()
        self.residual_by_kernel = False  # each residual add and the norm after it by `residual_kernel`
        if plans_per_shape() if by_rows is None else by_rows:
            serve_linears_by_rows(model)
            self.residual_by_kernel = residual_kernel.available()
            for layer in model.layers:
                attn = layer.self_attn
                attn.by_kernel = attention_kernel.serves(attn.heads, attn.kv_heads, attn.head_dim)
                attn.heads_by_kernel = heads_kernel.serves("qkv_proj" in attn, attn.head_dim)
        markov = model.markov_head
        serves = cuda.available() and FusedGreedyChain.serves(markov.markov_w1, markov.markov_w2)
        self.fused_chain = FusedGreedyChain(markov.markov_w1, markov.markov_w2) if serves else None
        self.compiled = compiled
        self._segments = Traces(self._traced_segment, limit=1024)  # segments x lane counts x widths
        self._contexts = Traces(lambda rows: self._context_keys_values)
        mx.eval(self.state_arrays(), model.parameters())  # built here, possibly evaluated on the engine thread

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """The target layers whose residuals this drafter reads (the target forward's `taps`)."""
        return self.config.target_layer_ids

    @property
    def width(self) -> int:
        """Default proposals per round."""
        return self.config.width

    def open_lane(self) -> LaneSlot:
        return self.slots.open()

    def close_lane(self, lane: LaneSlot) -> None:
        self.slots.close(lane)

    def kv_bytes(self) -> int:
        return sum(pool.capacity * pool.nbytes_per_position() for pool in self.kv)

    def kv_bytes_in_use(self) -> int:
        """Bytes of KV the open lanes' committed tokens occupy (`kv_bytes` is what is reserved)."""
        per_token = sum(pool.nbytes_per_position() for pool in self.kv) // self.max_lanes
        return per_token * self.slots.committed_tokens()

    def context_rows(self, lane: LaneSlot, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Copies of a lane's context keys and values at positions start..end-1,
        `[layers, kv_heads, n, D]` (lazy)."""
        if end > lane.length:
            raise ValueError(f"drafter slot {lane.slot} holds {lane.length} context rows, not {end}")
        return stacked_rows(self.kv, lane.slot, start, end)

    def restore_context(self, lane: LaneSlot, tokens: list[int], keys: mx.array, values: mx.array) -> None:
        """Start a fresh lane's context from the rows of `tokens` read before (see
        `context_rows`)."""
        if lane.length:
            raise ValueError(f"drafter slot {lane.slot} already holds {lane.length} rows; a prefix restores into a fresh lane only")
        if keys.shape[2] != len(tokens):
            raise ValueError(f"drafter slot {lane.slot}: {keys.shape[2]} context rows for {len(tokens)} tokens")
        put_stacked_rows(self.kv, lane.slot, keys, values)
        lane.length = keys.shape[2]

    def validate(self, proposal: Proposal) -> list[DraftError | None]:
        """Per-lane problems of an evaluated proposal (see `validate_proposal`)."""
        return validate_proposal(proposal)

    def state_arrays(self) -> list[mx.array]:
        """Every pool array, to evaluate appended context together with a round's outputs."""
        return [a for pool in self.kv for a in (pool.keys, pool.values)]

    def append(self, lanes: list[LaneSlot], taps: list[mx.array] | mx.array, tokens: list[list[int]],
               bucket_rows: bool = False) -> None:
        """Add newly committed rows to each lane's context: `taps[i]` is
        `[rows_i, n_taps * H_target]` for lane i's next rows (rows_i may be 0), the
        target's rows for the committed `tokens[i]`; or `taps` is every lane's rows in one
        array, lane after lane. `bucket_rows` pads the rows to a `row_bucket` (see there).
        Lazy."""
        counts = [len(ids) for ids in tokens]
        # A mismatch means the lane core let context and tokens drift apart.
        if isinstance(taps, mx.array):
            if taps.shape[0] != sum(counts):
                raise ValueError(f"drafter slots {[lane.slot for lane in lanes]}: {taps.shape[0]} tap rows for "
                                 f"{sum(counts)} committed tokens")
        else:
            for lane, rows, count in zip(lanes, taps, counts, strict=True):
                if rows.shape[0] != count:
                    raise ValueError(f"drafter slot {lane.slot}: {rows.shape[0]} tap rows for {count} committed tokens")
        slots, positions = [], []
        for lane, count in zip(lanes, counts, strict=True):
            slots += [lane.slot] * count
            positions += range(lane.length, lane.length + count)
        if not positions:
            return
        # Every row is its own one-row "lane" at its slot and position: one scatter per
        # layer however ragged the counts are. Padding repeats the last row, which writes
        # the same values to the same place again.
        pad = row_bucket(len(positions)) - len(positions) if bucket_rows else 0
        slots += slots[-1:] * pad
        positions += positions[-1:] * pad
        rows = taps if isinstance(taps, mx.array) else mx.concatenate(taps, axis=0)
        if pad:
            rows = mx.concatenate([rows, mx.repeat(rows[-1:], pad, axis=0)], axis=0)
        layout = RaggedLayout([1] * len(positions), positions)
        self._write_context(layout, layout.slot_ids(slots), rows)
        for lane, count in zip(lanes, counts):
            lane.length += count

    def append_window(self, lanes: list[LaneSlot], taps: mx.array, width: int, at: DeviceLengths) -> None:
        """Add a verify round's rows to each lane's context before the host knows how many
        it kept: lane i's `width` tap rows (`taps [N * width, n_taps * H_target]`, lane
        after lane) go at positions `at.lengths[i] ...`. The rows past what a lane keeps
        lie beyond its new length: no proposal reads them (a block sees its context and
        itself), and the lane's next block and append write over them. `landed` counts
        the kept rows once the host has read them. Lazy."""
        n = len(lanes)
        if taps.shape[0] != n * width:
            raise ValueError(f"drafter slots {[lane.slot for lane in lanes]}: {taps.shape[0]} tap rows for {n} windows of {width}")
        positions = (at.lengths[:, None] + mx.arange(width, dtype=mx.int32)[None, :]).reshape(-1)
        slots = [lane.slot for lane in lanes for _ in range(width)]
        layout = RaggedLayout([1] * len(slots), None, offsets_array=positions, reach=max(at.bounds) + width)
        self._write_context(layout, layout.slot_ids(slots), taps)

    def landed(self, lanes: list[LaneSlot], tokens: list[list[int]]) -> None:
        """The host has read which rows of an `append_window` each lane kept: its
        committed `tokens[i]` (their count is what the lane's context grew by)."""
        for lane, ids in zip(lanes, tokens, strict=True):
            lane.length += len(ids)

    def _write_context(self, layout: RaggedLayout, slot_ids: mx.array, rows: mx.array) -> None:
        """Every row of `rows`, its own one-row lane of `layout`, into the pools."""
        context = self._contexts(layout.lanes) if self.compiled else self._context_keys_values
        keys_values = context(rows, layout.offsets_array)
        for j, pool in enumerate(self.kv):
            pool.reserve(layout.span)
            pool.write(slot_ids, layout, keys_values[2 * j], keys_values[2 * j + 1])

    def _context_keys_values(self, rows: mx.array, positions: mx.array) -> list[mx.array]:
        """Context rows `[R, n_taps * H_target]` at their positions -> each layer's roped
        keys and values `[R, kv_heads, 1, D]` (flat: k0, v0, k1, ...; eager or traced)."""
        c = self.model.context(rows.astype(self.dtype))[:, None, :]  # [R, 1, H]
        return [a for layer in self.model.layers for a in layer.self_attn.keys_values(c, positions)]

    def propose(self, lanes: list[LaneSlot], anchors: list[int] | mx.array, width: int | None = None, pick: Pick | None = None,
                *, chain_logits: bool = True, confidences: bool = True, at: DeviceLengths | None = None) -> Proposal:
        """Draft `width` tokens after each lane's anchor (the last token the target
        emitted, at position `lane.length`), all lanes in one lazy forward. The anchors
        may be an array the host has not read, and `at` the lanes' lengths as the device
        holds them (see `append_window`).

        `pick(logits [N, V], k) -> tokens [N]` chooses x_{k+1} from the chain logits of
        row k (argmax when None); the lane core passes its sampler for temperature > 0.
        `chain_logits=False` leaves the float32 `[N, g, V]` chain logits out of the
        proposal (what greedy rounds never read); `confidences=False` the confidence
        head's (what a round priced by counted survival never reads)."""
        cfg = self.config
        g = cfg.width if width is None else width
        if not 1 <= g <= cfg.max_width:
            raise ValueError(f"draft width {g} is outside 1..{cfg.max_width}")
        if len(anchors) != len(lanes):
            raise ValueError(f"{len(lanes)} lanes but {len(anchors)} anchors")
        n = len(lanes)
        slots = [lane.slot for lane in lanes]
        if at is None:
            lengths = [lane.length for lane in lanes]
            layout = RaggedLayout([g] * n, lengths, KEY_BUCKET)
        else:
            layout = RaggedLayout([g] * n, None, KEY_BUCKET, offsets_array=at.lengths, reach=max(at.bounds) + g)
        for pool in self.kv:
            pool.reserve(layout.span)
        # No causal mask inside the block: each lane sees its context and its whole block;
        # only keys past its own block (other lanes' longer contexts, the bucket's
        # rounding) are hidden.
        mask = None
        if at is not None or layout.span != lengths[0] + g or len(set(lengths)) > 1:
            visible = mx.arange(layout.span, dtype=mx.int32)[None, :] < (layout.offsets_array + g)[:, None]
            mask = visible[:, None, None, :]
        # The block runs as segments between its layers' attention cores (see target.py);
        # with a pick (a host callable) the chain runs after the last, eagerly.
        anchors_array = anchors.astype(mx.int32) if isinstance(anchors, mx.array) else mx.array(anchors, dtype=mx.int32)
        h, attended, last = anchors_array, None, len(self.kv)
        for j in range(last + 1):
            args = [h, *([attended] if j else []), *([anchors_array] if j == last else []), layout.offsets_array]
            if self.compiled:
                outputs = self._segments(ProposalSegment(j, n, g, pick is None, chain_logits, confidences))(*args)
            else:
                outputs = self._segment_arrays(j, g, pick is None, chain_logits, confidences, *args)
            if j < len(self.kv):
                h, *qkv = outputs
                attended = self.model.layers[j].self_attn.core(*qkv, layout, slots, self.kv[j], mask)
        if pick is not None:
            outputs = self._chain(outputs[0], anchors_array, pick, chain_logits, confidences)
        tokens, faults, *rest = outputs
        scores = rest.pop(0) if cfg.enable_confidence_head and confidences else None
        logits = rest.pop(0) if chain_logits else None
        return Proposal(tokens, scores, logits, faults, cfg.vocab_size)

    def _traced_segment(self, spec: ProposalSegment):
        """`_segment_arrays` for one spec, as a function of arrays only."""
        return lambda *args: self._segment_arrays(spec.segment, spec.width, spec.greedy, spec.chain_logits, spec.confidences, *args)

    def _segment_arrays(self, j: int, g: int, greedy: bool, chain_logits: bool, confidences: bool,
                        *args: mx.array) -> list[mx.array]:
        """Segment j of a proposal, eager or traced: the rest of block layer j-1 once its
        attention core has run, and layer j's projections. In: the anchors (j = 0) or
        the block's rows and core j-1's output (j > 0), the anchors again (the last
        segment), the block's offsets. Out: the rows
        and (q, k, v) for core j; after the last layer, the final rows (a pick's chain
        runs after) or, greedy, `_chain`'s outputs."""
        cfg, layers = self.config, self.model.layers
        offsets, anchors = args[-1], args[-2]  # the anchors come to the first and the last segment
        layout = RaggedLayout([g] * offsets.shape[0], None, offsets_array=offsets)
        next_norm = layers[j].input_layernorm if j < len(layers) else self.model.norm
        if j == 0:
            block = mx.concatenate([anchors[:, None], mx.full((anchors.shape[0], g - 1), cfg.mask_token_id, dtype=mx.int32)], axis=1)
            h = self.embed(block).astype(self.dtype)
            normed = next_norm(h)
        else:
            h, normed = layers[j - 1].finish(args[0], args[1], next_norm, self.residual_by_kernel)
        if j < len(layers):
            return [h, *layers[j].self_attn.project(normed, layout)]
        return self._chain(normed, anchors, None, chain_logits, confidences) if greedy else [normed]

    def _chain(self, h: mx.array, anchors: mx.array, pick: Pick | None, keep_logits: bool, want_confidences: bool) -> list[mx.array]:
        """Block rows `h [N, g, H]` -> tokens, faults, the confidences (where there is a
        confidence head and they are wanted), the chain logits (when `keep_logits`): the
        Markov chain `l_k = U_k + w2(w1[prev_k])`, `x_{k+1} = pick(l_k)`."""
        cfg, g = self.config, h.shape[1]
        markov = self.model.markov_head
        scoring = cfg.enable_confidence_head and want_confidences
        base = self.tied_logits(h)  # U_k: row k proposes x_{k+1}
        if pick is None and not keep_logits and self.fused_chain is not None:
            tokens_arr, logits_arr = self.fused_chain(base, anchors), None
            prev_rows = lambda: markov.markov_w1(mx.concatenate([anchors[:, None], tokens_arr[:, :-1]], axis=1))
        else:
            prev = anchors
            tokens, logits, embedded = [], [], []
            for k in range(g):
                # Ids from a faulty pick are clipped for the lookup only; the raw ids are
                # returned so the fault is reported, never read out of bounds. An argmax (and
                # the anchor, the target's own token) is always in range.
                e = markov.markov_w1(prev if pick is None or k == 0 else mx.clip(prev, 0, cfg.vocab_size - 1))
                l_k = base[:, k].astype(mx.float32) + markov.markov_w2(e).astype(mx.float32)
                # An argmax's uint32 ids index w1 as they are: one cast of the stacked
                # tokens, not one per step (each a kernel of its own on a GPU).
                prev = mx.argmax(l_k, axis=-1) if pick is None else pick(l_k, k).astype(mx.int32)
                tokens.append(prev)
                logits.append(l_k)
                embedded.append(e)
            tokens_arr = mx.stack(tokens, axis=1).astype(mx.int32)
            prev_rows = lambda: mx.stack(embedded, axis=1)
            logits_arr = mx.stack(logits, axis=1) if keep_logits else None
        confidences = None
        if scoring:  # w1[prev_k] per row (`prev_rows`) is built only for a head that reads it
            features = mx.concatenate([h, prev_rows().astype(h.dtype)], axis=-1) if cfg.confidence_head_with_markov else h
            confidences = self.model.confidence_head(features)
        faults = draft_faults(tokens_arr, confidences, logits_arr if keep_logits else h, cfg.vocab_size)
        return [tokens_arr, faults, *([confidences] if scoring else []), *([logits_arr] if keep_logits else [])]

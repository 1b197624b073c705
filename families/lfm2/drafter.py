"""LiquidAI's DSpark drafter for LFM2 targets, in MLX.

A small Qwen3-style backbone reads the target's residual streams after a few layers (the
taps), drafts a whole block `[anchor] + [mask] * (g - 1)` in one forward, and turns it
into a chain of g proposals with a low-rank Markov token-transition head; a confidence
head says how likely each proposal is to survive verification. It has no embedding and
no head of its own: both are the target's tied table.

The runtime (`DSparkDrafter`) keeps each lane's context K/V in slot pools (cache.py),
appended only with committed rows, and proposes for many lanes in one batched forward.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .cache import KVPool, LaneSlot, RaggedLayout, SlotAllocator, Traces, row_bucket
from .config import CheckpointError, Lfm2Config, read_json
from .loader import DTYPES, load_layer_by_layer, read_tensors
from .model import Lfm2Model, attend, merged_linear, swiglu

log = logging.getLogger("laneserve.load")

MAX_VERIFY_WIDTH = 32  # rows of one lane's verify window: the anchor plus at most 31 drafts
MAX_MARKOV_RANK = 1024  # the released heads use 256; wider tables are refused, not guessed at
DRAFTER_BITS = (8,)  # the only opt-in quantization of the drafter's linear layers
QUANT_GROUP = 64


# Proposals round their key span up to this many rows (see RaggedLayout).
KEY_BUCKET = 256

class DraftError(RuntimeError):
    """A lane's round of proposals is unusable (non-finite numbers or an id outside the
    vocabulary); the round fails for that lane only."""

    def __init__(self, lane: int, reasons: list[str]):
        self.lane = lane
        self.reasons = reasons
        super().__init__(f"draft for lane {lane} is unusable: {'; '.join(reasons)}")


# --- config -----------------------------------------------------------------------------


def _field(raw: dict, key: str, default=None):
    value = raw.get(key, default)
    if value is None:
        raise CheckpointError(f"drafter config.json lacks '{key}'")
    return value


def _int(raw: dict, key: str, default: int | None = None, minimum: int = 1, maximum: int | None = None) -> int:
    value = _field(raw, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise CheckpointError(f"drafter config.json '{key}' must be an integer {bound}, got {value!r}")
    return value


def _bool(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"drafter config.json '{key}' must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    rope_traditional: bool  # interleaved pairing (`rope_is_neox_style` false)
    block_size: int  # trained proposals per round, at most MAX_VERIFY_WIDTH - 1
    width: int  # proposals per round at runtime: runtime_block_size or block_size
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool

    @property
    def max_width(self) -> int:
        """The widest block `propose` accepts: the trained width (under the verify ceiling)."""
        return self.block_size

    @classmethod
    def from_dict(cls, raw: dict) -> DSparkConfig:
        """Read a drafter config; fields may sit at top level or inside `dflash_config`
        (the nested value wins). Every refusal names its field."""
        nested = raw.get("dflash_config") or {}
        if not isinstance(nested, dict):
            raise CheckpointError(f"drafter config.json 'dflash_config' must be an object, got {nested!r}")
        raw = {**raw, **nested}
        hidden = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        kv_heads = _int(raw, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"drafter config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        vocab = _int(raw, "vocab_size")
        eps = raw.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise CheckpointError(f"drafter config.json 'rms_norm_eps' must be a finite positive number, got {eps!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"drafter config.json 'hidden_act' must be 'silu' (SwiGLU), got {raw['hidden_act']!r}")
        if raw.get("attention_bias", False):
            raise CheckpointError("drafter config.json 'attention_bias' is true; DSpark drafters have no attention biases")
        # Required (nested form first, as for the target): the published drafters differ
        # (1e6, 5e6, 1e7) and a wrong theta degrades with position instead of failing.
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise CheckpointError("drafter config.json lacks 'rope_theta'")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise CheckpointError(f"drafter config.json 'rope_theta' must be a finite positive number, got {theta!r}")
        mask = _int(raw, "mask_token_id", minimum=0)
        if mask >= vocab:
            raise CheckpointError(f"drafter config.json 'mask_token_id' {mask} is not below vocab_size {vocab}")
        target_layers = _int(raw, "num_target_layers", minimum=2)
        ids = _field(raw, "target_layer_ids")
        if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CheckpointError(f"drafter config.json 'target_layer_ids' must be a non-empty list of layer indices, got {ids!r}")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise CheckpointError(f"drafter config.json 'target_layer_ids' must be strictly increasing, got {ids}")
        if ids[0] < 0 or ids[-1] >= target_layers - 1:
            # The last layer's residual is what the target's head reads; taps come before it.
            raise CheckpointError(
                f"drafter config.json 'target_layer_ids' {ids} must lie in 0..{target_layers - 2} "
                f"(inside the {target_layers}-layer target, not its last layer)"
            )
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise CheckpointError(f"drafter config.json 'markov_head_type' {raw['markov_head_type']!r} is not supported; expected 'vanilla'")
        # A verify window is the anchor plus the drafts, at most MAX_VERIFY_WIDTH rows: a wider
        # trained block is a wrong file, not something to narrow silently.
        block = _int(raw, "block_size", maximum=MAX_VERIFY_WIDTH - 1)
        width = block if raw.get("runtime_block_size") is None else _int(raw, "runtime_block_size", maximum=block)
        head_dim = _int(raw, "head_dim", hidden // heads)
        if head_dim % 2:
            raise CheckpointError(f"drafter config.json 'head_dim' {head_dim} is odd; RoPE rotates pairs")
        return cls(
            hidden_size=hidden,
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(raw, "intermediate_size"),
            rms_norm_eps=float(eps),
            vocab_size=vocab,
            rope_theta=float(theta),
            rope_traditional=not _bool(raw, "rope_is_neox_style", False),
            block_size=block,
            width=width,
            mask_token_id=mask,
            target_layer_ids=tuple(ids),
            num_target_layers=target_layers,
            markov_rank=_int(raw, "markov_rank", maximum=MAX_MARKOV_RANK),
            enable_confidence_head=_bool(raw, "enable_confidence_head", True),
            confidence_head_with_markov=_bool(raw, "confidence_head_with_markov", True),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> DSparkConfig:
        return cls.from_dict(read_json(Path(path) / "config.json"))


def check_pairing(drafter: DSparkConfig, target: Lfm2Config) -> None:
    """Refuse a drafter trained for another target: its taps, embedding and head must fit."""
    if drafter.num_target_layers != target.num_layers:
        raise CheckpointError(
            f"drafter 'num_target_layers' {drafter.num_target_layers} does not match the target's {target.num_layers} layers"
        )
    if drafter.vocab_size != target.vocab_size:
        raise CheckpointError(f"drafter 'vocab_size' {drafter.vocab_size} does not match the target's {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        # The block is embedded with, and read out by, the target's table [V, H_target].
        raise CheckpointError(f"drafter 'hidden_size' {drafter.hidden_size} does not match the target's {target.hidden_size}")


# --- model ------------------------------------------------------------------------------


class DSparkAttention(nn.Module):
    """GQA with per-head RMSNorm on q and k, then RoPE (interleaved pairing by default).
    The block's queries attend over the lane's context keys and the whole block."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_theta, self.rope_traditional = cfg.rope_theta, cfg.rope_traditional
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def rope(self, x: mx.array, offset) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=self.rope_traditional, base=self.rope_theta, scale=1.0, offset=offset)

    def merge_projections(self) -> None:
        """Serve q, k and v from one matmul `qkv_proj` (where they merge exactly)."""
        merged = merged_linear([self.q_proj, self.k_proj, self.v_proj])
        if merged is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                self.pop(name)
            self.qkv_proj = merged

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """[N, T, H] -> q, k, v `[N, T, heads, D]` (q and k normed, no RoPE yet)."""
        n, t, _ = x.shape
        if "qkv_proj" in self:
            q_width = self.heads * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x), [q_width, q_width + self.kv_heads * self.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_norm(q.reshape(n, t, self.heads, self.head_dim))
        k = self.k_norm(k.reshape(n, t, self.kv_heads, self.head_dim))
        return q, k, v.reshape(n, t, self.kv_heads, self.head_dim)

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """[N, T, H] rows at positions offset.. -> roped keys and values [N, kv_heads, T, D].
        Merged projections compute q too and drop it: one matmul beats two on these few rows."""
        _, k, v = (t.transpose(0, 2, 1, 3) for t in self.qkv(x))
        return self.rope(k, offset), v

    def project(self, x: mx.array, layout: RaggedLayout) -> tuple[mx.array, mx.array, mx.array]:
        """Block rows `[N, g, H]` -> q, k, v `[N, heads, g, D]` at the block's positions."""
        offset = layout.rope_offset()
        q, k, v = (t.transpose(0, 2, 1, 3) for t in self.qkv(x))
        return self.rope(q, offset), self.rope(k, offset), v

    def core(self, q: mx.array, k: mx.array, v: mx.array, layout: RaggedLayout, slots: list[int], pool: KVPool, mask) -> mx.array:
        """The block's keys go to the pool just past the committed context (read this
        round only, overwritten by the next append); the block attends over the lane's
        context and itself."""
        pool.write(slots, layout, k, v)
        keys, values = pool.read(slots, layout)
        return attend(q, keys, values, self.scale, mask)

    def finish(self, o: mx.array) -> mx.array:
        n, _, g, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(n, g, -1))


class DSparkMLP(nn.Module):
    """SwiGLU: `down(silu(gate x) * up x)`."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def merge_projections(self) -> None:
        """Serve gate and up from one matmul `gate_up_proj` (where they merge exactly)."""
        merged = merged_linear([self.gate_proj, self.up_proj])
        if merged is not None:
            self.pop("gate_proj"), self.pop("up_proj")
            self.gate_up_proj = merged

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            return self.down_proj(swiglu(*mx.split(self.gate_up_proj(x), 2, axis=-1)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = DSparkMLP(cfg.hidden_size, cfg.intermediate_size)

    def project(self, h: mx.array, layout: RaggedLayout) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(h), layout)

    def finish(self, h: mx.array, attended: mx.array) -> mx.array:
        """The rest of the layer once its attention core has run."""
        h = h + self.self_attn.finish(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """Rank-r token transitions: `w2(w1[prev])` is added to the base logits of the row
    that proposes the token after `prev`."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """`sigmoid(proj([h ; w1[prev]]))`: the chance a proposal survives given that the
    ones before it did."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(x).astype(mx.float32)).squeeze(-1)


class DSparkModel(nn.Module):
    """The drafter's own weights. The target's table embeds the block and is its head."""

    def __init__(self, cfg: DSparkConfig, target_hidden: int):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DSparkLayer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))

    def context(self, taps: mx.array) -> mx.array:
        """Taps [R, n_taps * H_target] -> context rows `hidden_norm(fc(taps))` [R, H]."""
        return self.hidden_norm(self.fc(taps))

    def block(self, h: mx.array, layout: RaggedLayout, slots: list[int], pools: list[KVPool], mask) -> mx.array:
        """Embedded block [N, g, H] -> final-normed hidden rows `h_k` [N, g, H]: each
        layer's projections, its attention core, and the rest of it."""
        for layer, pool in zip(self.layers, pools):
            h = layer.finish(h, layer.self_attn.core(*layer.project(h, layout), layout, slots, pool, mask))
        return self.norm(h)


# --- runtime ----------------------------------------------------------------------------


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

    def __init__(self, model: DSparkModel, target_model: Lfm2Model, max_lanes: int = 16, compiled: bool = True):
        """`compiled`: context appends and proposals run as compiled functions, one trace
        per shape (see target.py)."""
        self.model = model
        self.config = model.config
        self.embed = target_model.embed_tokens  # borrowed: embeds the block and is the head
        self.max_lanes = max_lanes
        self.dtype = model.hidden_norm.weight.dtype
        cfg = self.config
        self.kv = [KVPool(max_lanes, cfg.num_kv_heads, cfg.head_dim, self.dtype) for _ in range(cfg.num_layers)]
        self.slots = SlotAllocator(max_lanes, self.kv, "drafter")
        for layer in model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()
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

    def validate(self, proposal: Proposal) -> list[DraftError | None]:
        """Per-lane problems of an evaluated proposal (see `validate_proposal`)."""
        return validate_proposal(proposal)

    def state_arrays(self) -> list[mx.array]:
        """Every pool array, to evaluate appended context together with a round's outputs."""
        return [a for pool in self.kv for a in (pool.keys, pool.values)]

    def append(self, lanes: list[LaneSlot], taps: list[mx.array], tokens: list[list[int]], bucket_rows: bool = False) -> None:
        """Add newly committed rows to each lane's context: `taps[i]` is
        `[rows_i, n_taps * H_target]` for lane i's next rows (rows_i may be 0), the
        target's rows for the committed `tokens[i]`. `bucket_rows` pads the rows to a
        `row_bucket` (see there). Lazy."""
        slots, positions, parts = [], [], []
        for lane, rows, ids in zip(lanes, taps, tokens, strict=True):
            count = rows.shape[0]
            if count != len(ids):  # the lane core let context and tokens drift apart
                raise ValueError(f"drafter slot {lane.slot}: {count} tap rows for {len(ids)} committed tokens")
            slots += [lane.slot] * count
            positions += range(lane.length, lane.length + count)
            parts.append(rows)
        if not positions:
            return
        # Every row is its own one-row "lane" at its slot and position: one scatter per
        # layer however ragged the counts are. Padding repeats the last row, which writes
        # the same values to the same place again.
        pad = row_bucket(len(positions)) - len(positions) if bucket_rows else 0
        slots += slots[-1:] * pad
        positions += positions[-1:] * pad
        rows = mx.concatenate(parts, axis=0)
        if pad:
            rows = mx.concatenate([rows, mx.repeat(rows[-1:], pad, axis=0)], axis=0)
        layout = RaggedLayout([1] * len(positions), positions)
        slot_ids = layout.slot_ids(slots)
        context = self._contexts(len(positions)) if self.compiled else self._context_keys_values
        keys_values = context(rows, layout.offsets_array)
        for j, pool in enumerate(self.kv):
            pool.reserve(layout.span)
            pool.write(slot_ids, layout, keys_values[2 * j], keys_values[2 * j + 1])
        for lane, rows in zip(lanes, taps):
            lane.length += rows.shape[0]

    def _context_keys_values(self, rows: mx.array, positions: mx.array) -> list[mx.array]:
        """Context rows `[R, n_taps * H_target]` at their positions -> each layer's roped
        keys and values `[R, kv_heads, 1, D]` (flat: k0, v0, k1, ...; eager or traced)."""
        c = self.model.context(rows.astype(self.dtype))[:, None, :]  # [R, 1, H]
        return [a for layer in self.model.layers for a in layer.self_attn.keys_values(c, positions)]

    def propose(self, lanes: list[LaneSlot], anchors: list[int], width: int | None = None, pick: Pick | None = None,
                *, chain_logits: bool = True) -> Proposal:
        """Draft `width` tokens after each lane's anchor (the last token the target
        emitted, at position `lane.length`), all lanes in one lazy forward.

        `pick(logits [N, V], k) -> tokens [N]` chooses x_{k+1} from the chain logits of
        row k (argmax when None); the lane core passes its sampler for temperature > 0.
        `chain_logits=False` leaves the float32 `[N, g, V]` chain logits out of the
        proposal (what greedy rounds never read)."""
        cfg = self.config
        g = cfg.width if width is None else width
        if not 1 <= g <= cfg.max_width:
            raise ValueError(f"draft width {g} is outside 1..{cfg.max_width}")
        if len(anchors) != len(lanes):
            raise ValueError(f"{len(lanes)} lanes but {len(anchors)} anchors")
        n = len(lanes)
        lengths = [lane.length for lane in lanes]
        slots = [lane.slot for lane in lanes]
        layout = RaggedLayout([g] * n, lengths, KEY_BUCKET)
        for pool in self.kv:
            pool.reserve(layout.span)
        # No causal mask inside the block: each lane sees its context and its whole block;
        # only keys past its own block (other lanes' longer contexts, the bucket's
        # rounding) are hidden.
        mask = None
        if layout.span != lengths[0] + g or len(set(lengths)) > 1:
            visible = mx.arange(layout.span, dtype=mx.int32)[None, :] < (layout.offsets_array + g)[:, None]
            mask = visible[:, None, None, :]
        # The block runs as segments between its layers' attention cores (see target.py);
        # with a pick (a host callable) the chain runs after the last, eagerly.
        anchors_array = mx.array(anchors, dtype=mx.int32)
        h, attended, last = anchors_array, None, len(self.kv)
        for j in range(last + 1):
            args = [h, *([attended] if j else []), *([anchors_array] if j == last else []), layout.offsets_array]
            if self.compiled:
                outputs = self._segments(ProposalSegment(j, n, g, pick is None, chain_logits))(*args)
            else:
                outputs = self._segment_arrays(j, g, pick is None, chain_logits, *args)
            if j < len(self.kv):
                h, *qkv = outputs
                attended = self.model.layers[j].self_attn.core(*qkv, layout, slots, self.kv[j], mask)
        if pick is not None:
            outputs = self._chain(outputs[0], anchors_array, pick, chain_logits)
        tokens, confidences, logits, faults = outputs if chain_logits else (outputs[0], outputs[1], None, outputs[2])
        if not cfg.enable_confidence_head:
            confidences = None
        return Proposal(tokens, confidences, logits, faults, cfg.vocab_size)

    def _traced_segment(self, spec: ProposalSegment):
        """`_segment_arrays` for one spec, as a function of arrays only."""
        return lambda *args: self._segment_arrays(spec.segment, spec.width, spec.greedy, spec.chain_logits, *args)

    def _segment_arrays(self, j: int, g: int, greedy: bool, chain_logits: bool, *args: mx.array) -> list[mx.array]:
        """Segment j of a proposal, eager or traced: the rest of block layer j-1 once its
        attention core has run, and layer j's projections. In: the anchors (j = 0) or
        the block's rows and core j-1's output (j > 0), the anchors again (the last
        segment), the block's offsets. Out: the rows
        and (q, k, v) for core j; after the last layer, the final rows (a pick's chain
        runs after) or, greedy, `_chain`'s outputs."""
        cfg, layers = self.config, self.model.layers
        offsets, anchors = args[-1], args[-2]  # the anchors come to the first and the last segment
        layout = RaggedLayout([g] * offsets.shape[0], None, offsets_array=offsets)
        if j == 0:
            block = mx.concatenate([anchors[:, None], mx.full((anchors.shape[0], g - 1), cfg.mask_token_id, dtype=mx.int32)], axis=1)
            h = self.embed(block).astype(self.dtype)
        else:
            h = layers[j - 1].finish(args[0], args[1])
        if j < len(layers):
            return [h, *layers[j].project(h, layout)]
        h = self.model.norm(h)
        return self._chain(h, anchors, None, chain_logits) if greedy else [h]

    def _chain(self, h: mx.array, anchors: mx.array, pick: Pick | None, keep_logits: bool) -> list[mx.array]:
        """Block rows `h [N, g, H]` -> tokens, confidences (zeros without a confidence
        head), the chain logits when `keep_logits`, faults: the Markov chain
        `l_k = U_k + w2(w1[prev_k])`, `x_{k+1} = pick(l_k)`."""
        cfg, g = self.config, h.shape[1]
        markov = self.model.markov_head
        base = self.embed.as_linear(h)  # U_k: row k proposes x_{k+1}
        prev = anchors
        tokens, logits, prev_rows = [], [], []
        for k in range(g):
            # Ids from a faulty pick are clipped for the lookup only; the raw ids are
            # returned so the fault is reported, never read out of bounds.
            e = markov.markov_w1(mx.clip(prev, 0, cfg.vocab_size - 1))
            l_k = base[:, k].astype(mx.float32) + markov.markov_w2(e).astype(mx.float32)
            prev = (mx.argmax(l_k, axis=-1) if pick is None else pick(l_k, k)).astype(mx.int32)
            tokens.append(prev)
            logits.append(l_k)
            prev_rows.append(e)
        tokens_arr = mx.stack(tokens, axis=1)
        logits_arr = mx.stack(logits, axis=1) if keep_logits else None
        confidences = None
        if cfg.enable_confidence_head:
            features = mx.concatenate([h, mx.stack(prev_rows, axis=1).astype(h.dtype)], axis=-1) if cfg.confidence_head_with_markov else h
            confidences = self.model.confidence_head(features)
        faults = draft_faults(tokens_arr, confidences, logits_arr if keep_logits else h, cfg.vocab_size)
        if confidences is None:  # a traced function returns arrays only
            confidences = mx.zeros(tokens_arr.shape, dtype=mx.float32)
        return [tokens_arr, confidences, *([logits_arr] if keep_logits else []), faults]


# --- loading ----------------------------------------------------------------------------


def _checked_tensors(model: DSparkModel, tensors: dict[str, mx.array], target_hidden: int) -> dict[str, mx.array]:
    """The tensors the model uses, each checked against its parameter's shape."""
    cfg = model.config
    expected = dict(nn.utils.tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"drafter lacks tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:5])}")
    for name, param in expected.items():
        got, want = tuple(tensors[name].shape), tuple(param.shape)
        if got == want:
            continue
        why = ""
        if name == "fc.weight":
            why = f" = [hidden {cfg.hidden_size}, {len(cfg.target_layer_ids)} taps x target hidden {target_hidden}]"
        elif name.startswith("markov_head."):
            why = f" = [target vocab {cfg.vocab_size}, markov_rank {cfg.markov_rank}]"
        raise CheckpointError(f"drafter tensor {name} has shape {got}, expected {want}{why}")
    not_float = [name for name in expected if not mx.issubdtype(tensors[name].dtype, mx.floating)]
    if not_float:
        dtype = str(tensors[not_float[0]].dtype).removeprefix("mlx.core.")
        raise CheckpointError(f"drafter tensor {not_float[0]} is {dtype}, not floating point")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        log.warning("drafter: ignoring %d tensors it does not use, e.g. %s", len(unexpected), unexpected[:3])
    return {name: tensors[name] for name in expected}


def load_drafter(
    path: str | Path,
    target_model: Lfm2Model,
    target_config: Lfm2Config,
    dtype: str | None = None,
    bits: int | None = None,
    max_lanes: int = 16,
    compiled: bool = True,
) -> DSparkDrafter:
    """Load a LiquidAI DSpark drafter directory for a loaded target.

    The config and its pairing with the target are checked before any weight is read;
    every refusal is a CheckpointError naming the field or tensor. `dtype` casts the
    floating weights ("float32", "float16", "bfloat16"; default: as stored). `bits=8`
    is an explicit opt-in that quantizes the drafter's linear layers (MLX affine, group
    64); the Markov table and the one-row confidence head stay as loaded. `compiled`:
    see DSparkDrafter."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter directory {path} {'is a file, not a directory' if path.exists() else 'does not exist'}")
    if bits is not None and bits not in DRAFTER_BITS:
        raise CheckpointError(f"drafter bits {bits!r} is not supported; use {' or '.join(map(str, DRAFTER_BITS))}, or leave it unset")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    cfg = DSparkConfig.from_dir(path)
    check_pairing(cfg, target_config)
    tensors = {name.removeprefix("model."): value for name, value in read_tensors(path).items()}
    model = DSparkModel(cfg, target_config.hidden_size)
    tensors = _checked_tensors(model, tensors, target_config.hidden_size)
    cast = DTYPES[dtype] if dtype else None
    load_layer_by_layer(
        model, tensors, lambda n, v: v.astype(cast) if cast is not None else v, "drafter tensor "
    )
    if bits is not None:
        nn.quantize(
            model,
            group_size=QUANT_GROUP,
            bits=bits,
            # Linear layers only, and only where the input width splits into groups.
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and p != "confidence_head.proj" and m.weight.shape[-1] % QUANT_GROUP == 0,
        )
        mx.eval(model.parameters())
        log.info("drafter linear layers quantized to %d bits (group %d)", bits, QUANT_GROUP)
    model.eval()
    return DSparkDrafter(model, target_model, max_lanes, compiled)

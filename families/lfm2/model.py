"""The LFM2 target, dense and mixture-of-experts, in MLX.

Each decoder layer is pre-norm: `h = x + op(operator_norm(x))`, `out = h + ffn(ffn_norm(h))`
with `op` a gated short convolution or grouped-query attention. Layers run two ways:
over whole sequences (`__call__`, used by training and references), and over the ragged
rows of a serving round (`ragged`), where every lane brings its own rows at its own
position and its state lives in slot pools (cache.py).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import attention_kernel, conv_kernel, expert_kernel, heads_kernel, residual_kernel, row_kernel
from .residual_kernel import add_norm
from .cache import ConvPool, KVPool, RaggedLayout, plans_per_shape
from .config import Lfm2Config

# Queries up to this many rows per lane (decode steps, verify windows, draft blocks) are
# attended with plain matmuls, or on CUDA by `attention_kernel` straight from the KV pool
# (see Attention.core; it also takes prompt chunks up to its MAX_ROWS): the fused kernel
# of a GPU backend may build a plan for every new shape (cuDNN's take tens of
# milliseconds), and these shapes change from round to round. Longer queries (prompt
# chunks) take the fused kernel, except where the backend plans per shape: there only
# chunks of a multiple of STEADY_QUERY rows do. A full chunk's shape recurs from prompt
# to prompt (its keys end at a chunk boundary), while a prompt's last, partial chunk is
# a new length almost every request: on the H200 a new 1,000-token prompt took 101 ms
# to read where one of a length seen before took 31. A partial chunk over a long context
# still takes the fused kernel: its plan is small beside its work there, and the matmul
# path would hold all of its scores at once.
SMALL_QUERY = 32
STEADY_QUERY = 256
MATMUL_SCORES = 2**27  # scores (lanes x heads x rows x keys) a partial chunk's matmuls may hold


def fused_attention(rows: int, scores: int = 0) -> bool:
    """Whether queries of `rows` rows per lane, `scores` attention scores in all, take
    the backend's fused attention kernel."""
    if rows == 1:
        return True
    if rows <= SMALL_QUERY:
        return False
    return rows % STEADY_QUERY == 0 or scores > MATMUL_SCORES or not plans_per_shape()


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask, rows: int | None = None) -> mx.array:
    """Grouped-query attention `softmax(q k^T * scale + mask) v`: q `[N, heads, T, D]`,
    keys and values `[N, kv_heads, S, D]`, mask boolean `[N, 1, T, S]`, "causal"
    (bottom-right aligned: row j sees the first S - T + 1 + j keys) or None. `rows`: the
    rows a lane brought where T pads them (a steady prompt read): a partial chunk padded
    to a multiple of STEADY_QUERY keeps to the matmuls, its key span no steadier than before."""
    n, heads, t, d = q.shape
    if fused_attention(rows or t, n * heads * t * keys.shape[2]):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    kv_heads, s = keys.shape[1], keys.shape[2]
    if isinstance(mask, str):
        mask = (mx.arange(s, dtype=mx.int32)[None, :] <= mx.arange(s - t, s, dtype=mx.int32)[:, None])[None, None]
    group = heads // kv_heads
    q = (q * scale).reshape(n, kv_heads, group * t, d)  # a kv head's query heads, row after row
    scores = (q @ keys.swapaxes(-1, -2)).reshape(n, kv_heads, group, t, -1)
    if mask is not None:
        scores = mx.where(mask[:, :, None], scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1, precise=True).reshape(n, kv_heads, group * t, -1)
    return (weights @ values).reshape(n, heads, t, d)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """`silu(gate) * up`, one fused kernel."""
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def multiply_add(*terms: mx.array) -> mx.array:
    """`a0 * b0 + a1 * b1 + ...` for terms `(a0, b0, a1, b1, ...)`, one fused kernel."""
    out = terms[0] * terms[1]
    for a, b in zip(terms[2::2], terms[3::2]):
        out = out + a * b
    return out


def heads_first(x: mx.array) -> mx.array:
    """`[N, T, heads, D]` -> `[N, heads, T, D]`; for one row (T = 1) a reshape, since a
    transpose would give the row axis of size 1 a stride of its own, and MLX's RMSNorm
    copies an input whose row stride is not its width."""
    n, t, heads, d = x.shape
    return x.reshape(n, heads, 1, d) if t == 1 else x.transpose(0, 2, 1, 3)


def depthwise_causal_conv(window: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """`[N, L-1+T, H]` -> `[N, T, H]`: row t is `sum_k weight[:, k] * window[t + k]`, MLX's
    conv1d layout `[H, L, 1]`. Spelled as L multiply-adds (one fused kernel), which need
    no per-shape plan."""
    taps = weight.shape[1]
    length = window.shape[1] - taps + 1
    out = multiply_add(*(t for k in range(taps) for t in (window[:, k : k + length], weight[:, k, 0])))
    return out if bias is None else out + bias


# MLX's CUDA backend multiplies one row by its own GEMV kernel, but several rows through
# cuBLASLt, building the GEMM's descriptors and asking its heuristic on every call: some
# tens of microseconds of host time per matmul, more than a small weight's whole product
# and, over the hundred-odd maps of a released model's step, more than its weights take
# to read (a 16-lane step of the 2.6B shape issued as many kernels as a one-lane step and
# took 2.6 times as long). A few rows are served instead without cuBLASLt: times a small
# weight (at most 4 MiB: every map of the embedded default), up to the widest verify
# window (32 rows, `lanes.round.VERIFY_WIDTH_CEILING`), as one matrix-vector product per
# row, one batched GEMV launch reading the weight once per row from cache; times a larger
# one, up to 16 rows (the kernel's one tile), by laneserve's own kernel (`row_kernel`,
# CUDA only), which reads it once.
ROW_PRODUCT_ROWS = 32
ROW_PRODUCT_BYTES = 4 * 2**20
ROW_KERNEL_ROWS = row_kernel.MAX_ROWS


def row_products(weight: mx.array, x: mx.array) -> mx.array:
    """`x @ weight.T` for `x [..., K]` and `weight [N, K]`: one matrix-vector product per
    row for one row, or for a small weight and up to ROW_PRODUCT_ROWS rows, the row
    kernel for a larger one and 2..ROW_KERNEL_ROWS rows (where it serves), else one
    matmul."""
    rows = x.size // x.shape[-1]
    # One row of any weight too: the same GEMV as `x @ weight.T`, minus a copy. A fused
    # kernel's output keeps its first input's strides, so SwiGLU over one row sliced from
    # w1|w3's product keeps that wide row's stride, and a matmul copies a row operand whose
    # stride is not its width (one copy per layer of a one-lane step); the column's view
    # is canonical.
    if rows == 1 or (rows <= ROW_PRODUCT_ROWS and weight.nbytes <= ROW_PRODUCT_BYTES):
        return (weight @ x.reshape(rows, -1, 1)).reshape(*x.shape[:-1], weight.shape[0])
    if 1 < rows <= ROW_KERNEL_ROWS and row_kernel.available() and row_kernel.serves(weight):
        return row_kernel.rows_times_weight(x.reshape(rows, -1), weight).reshape(*x.shape[:-1], weight.shape[0])
    return x @ weight.T


def served_by_rows(weight: mx.array) -> bool:
    """Whether `row_products` serves a few rows times `weight` without cuBLASLt."""
    return weight.nbytes <= ROW_PRODUCT_BYTES or (row_kernel.available() and row_kernel.serves(weight))


class RowProductLinear(nn.Module):
    """A linear map served by `row_products`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        y = row_products(self.weight, x)
        return y + self.bias if "bias" in self else y


def serve_linears_by_rows(model: nn.Module) -> None:
    """Serve every unquantized linear map of `model` that `row_products` serves without
    cuBLASLt (see there) by `row_products`."""
    def served(child):
        return RowProductLinear(child) if type(child) is nn.Linear and served_by_rows(child.weight) else child

    for _, module in list(model.named_modules()):
        for name, child in list(module.items()):
            module[name] = [served(c) for c in child] if isinstance(child, list) else served(child)


def merged_linear(parts: list[nn.Module]) -> nn.Module | None:
    """One linear map whose output is the parts' outputs side by side, or None where they
    cannot be merged exactly (mixed or differently quantized parts).

    Weights are `[out, in]` and quantization groups run along `in`, so concatenating
    along `out` (weights, scales, biases alike) computes exactly what the parts did."""
    first = parts[0]
    if {type(p) for p in parts} not in ({nn.Linear}, {nn.QuantizedLinear}) or len({"bias" in p for p in parts}) != 1:
        return None
    quantized = isinstance(first, nn.QuantizedLinear)
    if quantized and len({(p.group_size, p.bits, p.mode) for p in parts}) != 1:
        return None
    merged = {name: mx.concatenate([p[name] for p in parts]) for name in ("weight", "scales", "biases", "bias") if name in first}
    outputs, has_bias = merged["weight"].shape[0], "bias" in first
    # The new module's initial weights are lazy and replaced before anything evaluates them.
    if quantized:
        inputs = first.weight.shape[1] * 32 // first.bits  # packed into uint32 words
        module = nn.QuantizedLinear(inputs, outputs, has_bias, first.group_size, first.bits, first.mode)
    else:
        module = nn.Linear(first.weight.shape[1], outputs, bias=has_bias)
    for name, value in merged.items():
        setattr(module, name, value)
    return module


def merge_parts(module: nn.Module, names: tuple[str, ...], merged_name: str, merge=merged_linear) -> None:
    """Serve `module`'s linear parts `names` from one matmul `merged_name`, where `merge`
    joins them exactly (see `merged_linear`); otherwise leave them as they are."""
    merged = merge([module[name] for name in names])
    if merged is not None:
        for name in names:
            module.pop(name)
        setattr(module, merged_name, merged)


class ShortConv(nn.Module):
    """`B, C, X = split(in_proj(x))`; `y = out_proj(C * causal_conv(B * X))`."""

    by_kernel = False  # a round's gated conv as one `conv_kernel` launch (see Lfm2Model.serve_by_rows)

    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        self.kernel = cfg.conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.conv_bias)
        # Depthwise: MLX's conv1d layout [out, kernel, in / groups].
        self.conv = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, cfg.conv_kernel, groups=cfg.hidden_size, bias=cfg.conv_bias)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.conv_bias)

    def gates(self, x: mx.array) -> tuple[mx.array, mx.array]:
        b, c, x = mx.split(self.in_proj(x), 3, axis=-1)
        return b * x, c

    def causal_conv(self, window: mx.array) -> mx.array:
        return depthwise_causal_conv(window, self.conv.weight, self.conv.get("bias"))

    def __call__(self, x: mx.array) -> mx.array:
        u, c = self.gates(x)
        v = self.causal_conv(mx.pad(u, [(0, 0), (self.kernel - 1, 0), (0, 0)]))
        return self.out_proj(c * v)

    def ragged(self, x: mx.array, layout: RaggedLayout, slots: list[int] | mx.array, pool: ConvPool,
               keep: bool = False) -> tuple[mx.array, mx.array]:
        """Packed rows -> packed outputs, and the conv input `[N, L-1+W, H]` (the state
        before the round, read from `pool` at the lanes' slots, followed by this round's
        `u` rows) from which commit rebuilds the state after any number of accepted rows.
        `keep` (a one-row round): `pool` is left holding each lane's state with its row
        kept. Served by `conv_kernel` where `by_kernel` says so and every lane feeds the
        same few rows."""
        z = self.in_proj(x)
        if self.by_kernel and layout.uniform and layout.width <= conv_kernel.MAX_ROWS:
            weight = self.conv.weight
            gated, window, kept = conv_kernel.gated_conv(
                z.reshape(layout.rows, -1), pool.state, layout.slot_ids(slots), weight.reshape(weight.shape[0], -1),
                self.conv.get("bias"), layout.width, keep)
            if keep:
                pool.state = kept
            return self.out_proj(gated), window
        b, c, x = mx.split(z, 3, axis=-1)
        window = mx.concatenate([pool.read(slots, layout), layout.pad(b * x)], axis=1)
        v = layout.unpad(self.causal_conv(window))
        if keep:
            pool.write(slots, layout, window[:, 1 - self.kernel :])
        return self.out_proj(c * v), window


class Attention(nn.Module):
    """GQA with per-head RMSNorm on q and k before split-half ("neox") RoPE."""

    by_kernel = False  # a few rows per lane attended by `attention_kernel` (see Lfm2Model.serve_by_rows)
    heads_by_kernel = False  # q, k and v heads normed and rotated by `heads_kernel` (likewise)

    def __init__(self, cfg: Lfm2Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_layernorm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
        self.k_layernorm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)

    def rope(self, x: mx.array, offset) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)

    def merge_projections(self) -> None:
        """Serve q, k and v from one matmul `qkv_proj` (where they merge exactly)."""
        merge_parts(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def qkv(self, x: mx.array, layout: RaggedLayout | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """`[N, T, H]`, or a round's packed rows `[R, H]` padded by `layout` -> q, k, v as
        `[N, heads, T, D]`, q and k normed (no RoPE yet). Normed once the heads lead: the
        norm's output is then contiguous and RoPE rotates it in place, where RoPE copies
        a transposed input (MLX's CUDA backend: q's and k's, in every attention layer of
        a verify or a drafter block)."""
        lead = x.shape[:-1]
        if "qkv_proj" in self:
            q_width = self.heads * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x), [q_width, q_width + self.kv_heads * self.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.reshape(*lead, -1, self.head_dim) for t in (q, k, v))
        if layout is not None:
            q, k, v = (layout.pad(t) for t in (q, k, v))
        q, k, v = (heads_first(t) for t in (q, k, v))
        return self.q_layernorm(q), self.k_layernorm(k), v

    def __call__(self, x: mx.array) -> mx.array:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x)
        q, k = self.rope(q, 0), self.rope(k, 0)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
        return self.out_proj(o.transpose(0, 2, 1, 3).reshape(batch, length, -1))

    def project(self, x: mx.array, layout: RaggedLayout) -> tuple[mx.array, mx.array, mx.array]:
        """Packed rows -> q, k, v `[N, heads, W, D]` at the lanes' positions (RoPE applied)."""
        if self.heads_by_kernel and layout.uniform:
            return heads_kernel.project_heads(
                self.qkv_proj(x), self.q_layernorm.weight, self.k_layernorm.weight, layout.offsets_array, heads=self.heads,
                kv_heads=self.kv_heads, width=layout.width, eps=self.q_layernorm.eps, base=self.rope_theta, traditional=False)
        q, k, v = self.qkv(x, layout)
        offset = layout.rope_offset()
        return self.rope(q, offset), self.rope(k, offset), v

    def core(self, q: mx.array, k: mx.array, v: mx.array, layout: RaggedLayout, slots: list[int], pool: KVPool) -> mx.array:
        """The round's keys and values into the pool, then attention over each lane's keys."""
        pool.write(slots, layout, k, v)
        if self.by_kernel and attention_kernel.takes(layout.lanes, layout.width, layout.span):
            return attention_kernel.pool_attention(q, *pool.views(), layout.slot_ids(slots), layout.offsets_array, self.scale,
                                                   causal=True)
        keys, values = pool.read(slots, layout)
        return attend(q, keys, values, self.scale, layout.attention_mask(layout.span), rows=layout.own_width)

    def finish(self, o: mx.array, layout: RaggedLayout) -> mx.array:
        """Attention output `[N, heads, W, D]` -> packed rows after `out_proj`."""
        return self.out_proj(layout.unpad(o.transpose(0, 2, 1, 3).reshape(layout.lanes, layout.width, -1)))

    def ragged(self, x: mx.array, layout: RaggedLayout, slots: list[int], pool: KVPool) -> mx.array:
        return self.finish(self.core(*self.project(x, layout), layout, slots, pool), layout)


class DenseFFN(nn.Module):
    """`w2(silu(w1 x) * w3 x)`."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)

    def merge_projections(self) -> None:
        """Serve w1 and w3 from one matmul `w13` (where they merge exactly)."""
        merge_parts(self, ("w1", "w3"), "w13")

    def __call__(self, x: mx.array) -> mx.array:
        if "w13" in self:
            return self.w2(swiglu(*mx.split(self.w13(x), 2, axis=-1)))
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class ExpertLinear(nn.Module):
    """One linear map per expert, `weight [E, out, in]`, applied to the chosen experts."""

    def __init__(self, experts: int, inputs: int, outputs: int):
        super().__init__()
        self.weight = mx.zeros((experts, outputs, inputs))

    def __call__(self, x: mx.array, experts: mx.array, sorted_experts: bool) -> mx.array:
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=experts, sorted_indices=sorted_experts)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        quantized = QuantizedExpertLinear(group_size, bits, mode)
        quantized.weight, quantized.scales, *biases = mx.quantize(self.weight, group_size, bits, mode=mode)
        if biases:
            quantized.biases = biases[0]
        return quantized


class QuantizedExpertLinear(nn.Module):
    def __init__(self, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.freeze()

    def __call__(self, x: mx.array, experts: mx.array, sorted_experts: bool) -> mx.array:
        return mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=experts, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_experts,
        )


def merged_expert_linear(parts: list[nn.Module]) -> nn.Module | None:
    """`merged_linear` for per-expert maps `[E, out, in]`: outputs side by side."""
    first = parts[0]
    if all(type(p) is ExpertLinear for p in parts):
        experts, _, inputs = first.weight.shape
        module = ExpertLinear(experts, inputs, sum(p.weight.shape[1] for p in parts))  # lazy zeros, replaced below
    elif all(type(p) is QuantizedExpertLinear for p in parts) and len({(p.group_size, p.bits, p.mode) for p in parts}) == 1:
        module = QuantizedExpertLinear(first.group_size, first.bits, first.mode)
    else:
        return None
    for name in ("weight", "scales", "biases"):
        if name in first:
            setattr(module, name, mx.concatenate([p[name] for p in parts], axis=1))
    return module


class Experts(nn.Module):
    """The routed experts' SwiGLU, stacked: w1, w3 `[E, I, H]`, w2 `[E, H, I]`."""

    by_kernel = False  # a few rows multiplied by `expert_kernel` (see serve_by_kernel)

    def __init__(self, experts: int, hidden: int, width: int):
        super().__init__()
        self.w1 = ExpertLinear(experts, hidden, width)
        self.w3 = ExpertLinear(experts, hidden, width)
        self.w2 = ExpertLinear(experts, width, hidden)

    def merge_projections(self) -> None:
        """Serve w1 and w3 from one gathered matmul `w13` (where they merge exactly)."""
        merge_parts(self, ("w1", "w3"), "w13", merge=merged_expert_linear)

    def maps(self) -> list[nn.Module]:
        return [self[name] for name in ("w13", "w1", "w3", "w2") if name in self]

    def serve_by_kernel(self) -> None:
        """Multiply 2-16 rows by their experts with `expert_kernel` (CUDA only; one row
        keeps gather_mm's GEMV, measured faster there) where every map is unquantized in
        its dtypes."""
        self.by_kernel = expert_kernel.available() and all(
            type(m) is ExpertLinear and expert_kernel.serves(m.weight, 1, 1) for m in self.maps())

    def __call__(self, x: mx.array, chosen: mx.array) -> mx.array:
        """x [R, H], chosen [R, k] -> [R, k, H]."""
        rows, k = chosen.shape
        if self.by_kernel and rows > 1 and expert_kernel.serves(self.maps()[0].weight, rows, k):
            return self.kernel_products(x, chosen).reshape(rows, k, -1)
        # Many rows: sort the (row, expert) pairs by expert so each expert's weights are
        # read once; x becomes [R*k, 1, H] against indices [R*k]. The axis is inserted
        # before the gather, whose output has a row stride of H: MLX 0.32's CUDA sorted
        # gather_mm takes the row stride from the singleton axis, which an inserted axis
        # gives a stride of 1 (silently wrong products, ml-explore/mlx#4253).
        sort = chosen.size >= 64
        if sort:
            order = mx.argsort(chosen.flatten())
            x, index = x[:, None, :][order // k], chosen.flatten()[order]
        else:
            x, index = x[:, None, None, :], chosen  # [R, 1, 1, H] against [R, k]
        if "w13" in self:
            y = self.w2(swiglu(*mx.split(self.w13(x, index, sort), 2, axis=-1)), index, sort)
        else:
            y = self.w2(swiglu(self.w1(x, index, sort), self.w3(x, index, sort)), index, sort)
        if sort:
            return y[mx.argsort(order)].reshape(rows, k, -1)
        return y.squeeze(-2)

    def kernel_products(self, x: mx.array, chosen: mx.array) -> mx.array:
        """The experts' SwiGLU by `expert_kernel`: rows and choices as they come, no sort
        and no gathers -> `[R * k, H]`."""
        times = expert_kernel.rows_times_experts
        chosen = chosen.astype(mx.int32)  # once for the products (the router's top k are uint32)
        if "w13" in self:
            h = swiglu(*mx.split(times(x, self.w13.weight, chosen), 2, axis=-1))
        else:
            h = swiglu(times(x, self.w1.weight, chosen), times(x, self.w3.weight, chosen))
        return times(h, self.w2.weight, chosen)


class SparseMoE(nn.Module):
    """Sigmoid routing in float32: top-k by `score + expert_bias` (the bias only selects),
    weights are the unbiased scores of the chosen experts, renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`. No shared expert."""

    def __init__(self, cfg: Lfm2Config, width: int):
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.use_expert_bias:
            self.expert_bias = mx.zeros((cfg.num_experts,), dtype=mx.float32)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, width)

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        if isinstance(self.gate, nn.QuantizedLinear):
            scores = mx.sigmoid(self.gate(x).astype(mx.float32))
        elif isinstance(self.gate, RowProductLinear):  # served by rows (see Lfm2Model.serve_by_rows)
            scores = mx.sigmoid(row_products(self.gate.weight.astype(mx.float32), x.astype(mx.float32)))
        else:
            scores = mx.sigmoid(x.astype(mx.float32) @ self.gate.weight.astype(mx.float32).T)
        ranking = scores + self["expert_bias"] if "expert_bias" in self else scores
        chosen = mx.stop_gradient(mx.argpartition(-ranking, kth=self.top_k - 1, axis=-1)[:, : self.top_k])
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-6)
        weights = (weights * self.scaling).astype(x.dtype)
        y = (self.experts(x, chosen) * weights[..., None]).sum(axis=-2)
        return y.reshape(*lead, -1).astype(x.dtype)  # experts may run wider (float32 on the CPU: see loader)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Lfm2Config, index: int, ffn_width: int):
        super().__init__()
        self.is_attention = cfg.layer_kinds[index] == "full_attention"
        if self.is_attention:
            self.self_attn = Attention(cfg)
        else:
            self.conv = ShortConv(cfg)
        self.feed_forward = SparseMoE(cfg, ffn_width) if cfg.is_moe_layer(index) else DenseFFN(cfg.hidden_size, ffn_width)
        self.operator_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def __call__(self, x: mx.array) -> mx.array:
        op = self.self_attn if self.is_attention else self.conv
        h = x + op(self.operator_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2Model(nn.Module):
    residual_by_kernel = False  # each residual add and the norm after it by `residual_kernel` (see serve_by_rows)

    def __init__(self, cfg: Lfm2Config, ffn_widths: list[int]):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i, w) for i, w in enumerate(ffn_widths)]
        self.embedding_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def merge_projections(self) -> None:
        """Serve with `q|k|v` and `w1|w3` each as one matmul: fewer, larger kernels per
        step. Layer by layer, so the weights are never held twice. Training and export
        keep the separate maps of the checkpoint."""
        for layer in self.layers:
            if layer.is_attention:
                layer.self_attn.merge_projections()
            ffn = layer.feed_forward
            (ffn.experts if isinstance(ffn, SparseMoE) else ffn).merge_projections()
            mx.eval(layer.parameters())

    def serve_by_rows(self) -> None:
        """Serve a few rows times the weights by `row_products`, the tied head too where
        its table is not quantized, a few rows times their experts by `expert_kernel`, each
        conv layer's gated conv by `conv_kernel` and a few query rows per lane by
        `attention_kernel`, their q, k and v heads by `heads_kernel`, and each residual
        add with the norm after it by `residual_kernel` (a GPU backend's choice, see there)."""
        serve_linears_by_rows(self)
        self.residual_by_kernel = residual_kernel.available()
        for layer in self.layers:
            if layer.is_attention:
                attn = layer.self_attn
                attn.by_kernel = attention_kernel.serves(attn.heads, attn.kv_heads, attn.head_dim)
                attn.heads_by_kernel = heads_kernel.serves("qkv_proj" in attn, attn.head_dim)
            else:
                layer.conv.by_kernel = conv_kernel.available()
            if isinstance(layer.feed_forward, SparseMoE):
                layer.feed_forward.experts.serve_by_kernel()
        table = self.embed_tokens
        self.head_by_rows = type(table) is nn.Embedding and served_by_rows(table.weight)

    def tied_logits(self, x: mx.array) -> mx.array:
        """`x @ embed_tokens.T`: the tied table read out as the vocabulary's logits."""
        if getattr(self, "head_by_rows", False):
            return row_products(self.embed_tokens.weight, x)
        return self.embed_tokens.as_linear(x)

    def head(self, h: mx.array) -> mx.array:
        """Final norm, then the tied head: `logits = norm(h) @ embed_tokens.T`."""
        return self.tied_logits(self.embedding_norm(h))

    def __call__(self, tokens: mx.array, taps: tuple[int, ...] = ()) -> tuple[mx.array, list[mx.array]]:
        """Whole sequences `[B, T]` from position 0 -> residual `[B, T, H]` after the last
        layer (before the final norm), and the residual after each layer in `taps`."""
        h = self.embed_tokens(tokens)
        tapped = []
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i in taps:
                tapped.append(h)
        return h, tapped

    def ragged(
        self,
        tokens: mx.array,
        layout: RaggedLayout,
        slots: list[int],
        kv: dict[int, KVPool],
        conv: dict[int, ConvPool],
        taps: tuple[int, ...] = (),
    ) -> tuple[mx.array, list[mx.array], dict[int, mx.array]]:
        """One forward over a round's packed rows `[R]`: every layer runs once over all
        lanes. Attention rows are written to the KV pools at their positions; conv
        states are left untouched: the conv input windows are returned instead, so the
        caller rebuilds each state once it knows how many rows each lane keeps.

        Run as the segments between attention cores (see `segment`), the way a compiled
        round runs them."""
        h, attended, tapped, windows = self.embed_tokens(tokens), None, [], {}
        for j in range(len(self.config.attention_layers) + 1):
            h, qkv, seg_tapped, seg_windows = self.segment(j, h, attended, layout, slots, conv, taps)
            tapped += seg_tapped
            windows.update(seg_windows)
            if qkv is not None:
                i = self.config.attention_layers[j]
                attended = self.layers[i].self_attn.core(*qkv, layout, slots, kv[i])
        return h, tapped, windows

    def segment(
        self,
        j: int,
        h: mx.array,
        attended: mx.array | None,
        layout: RaggedLayout,
        slots: list[int],
        conv: dict[int, ConvPool],
        taps: tuple[int, ...],
        keep: bool = False,
    ) -> tuple[mx.array, tuple | None, list[mx.array], dict[int, mx.array]]:
        """Segment j of a ragged forward: everything between attention core j-1 and
        attention core j. It finishes attention layer j-1 from its core's output
        `attended` (out_proj, residual, FFN), runs the conv layers up to attention layer
        j and that layer's projections: -> residual rows, the (q, k, v) for core j (None
        after the last), the residuals of tap layers in it, the conv windows. The cores
        (KV pool writes and attention over each lane's keys) run between segments.
        `keep` (one-row rounds): each conv pool is left holding its lanes' states with
        their row kept."""
        # Each residual add goes with the norm after it (`add_norm`): `normed` is the
        # next layer's normed input, from the add that ended the layer before.
        tapped, windows, normed = [], {}, None
        for i in self.segment_layers(j):
            layer = self.layers[i]
            if layer.is_attention:  # finished from its core's output
                r = layer.self_attn.finish(attended, layout)
            else:
                normed = layer.operator_norm(h) if normed is None else normed
                r, windows[i] = layer.conv.ragged(normed, layout, slots, conv[i], keep)
            h, normed = add_norm(h, r, layer.ffn_norm, self.residual_by_kernel)
            r = layer.feed_forward(normed)
            if i + 1 < len(self.layers):
                h, normed = add_norm(h, r, self.layers[i + 1].operator_norm, self.residual_by_kernel)
            else:
                h, normed = h + r, None
            if i in taps:
                tapped.append(h)
        qkv = None
        if j < len(self.config.attention_layers):
            layer = self.layers[self.config.attention_layers[j]]
            qkv = layer.self_attn.project(layer.operator_norm(h) if normed is None else normed, layout)
        return h, qkv, tapped, windows

    def segment_layers(self, j: int) -> range:
        """The layers segment j completes: attention layer j-1 (from its core's output)
        and the conv layers before attention layer j."""
        cores = self.config.attention_layers
        return range(cores[j - 1] if j > 0 else 0, cores[j] if j < len(cores) else len(self.layers))

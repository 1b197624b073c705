"""An attention layer's q, k and v heads from its merged projection's rows, normed and
rotated, as one CUDA kernel.

As MLX operations, q and k are split from `qkv_proj`'s rows and put heads first (a copy
each where a split's rows are not contiguous), RMS-normed per head (a kernel each), and
rotated by RoPE at each row's position (a kernel each): six kernels per attention layer
in every target round and drafter block, and three per drafter layer in each context
append, each paid in host time (a round on the H200 is bound by it, not by the
arithmetic). Here one warp per row and head reads the head straight from the projection's
row, takes the RMS of a q or k head in float32, rounds the normed head to the model's
dtype (as the norm's output is), rotates it at the row's position in float32 (split-half
pairs for the target, interleaved for a DSpark drafter) and rounds again, and writes q, k
and v heads first and contiguous, as the attention cores and the KV pools read them.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .cuda import available as available  # re-exported: where this kernel can serve
from .cuda import float_bits

THREADS = 256

# Template constants: T (dtype), D (head dim, even), HQ and HKV (query and KV heads), W
# (rows per lane), TRADITIONAL (interleaved pairs), WANT_Q, EPS_BITS and LOG2_BASE_BITS
# (float32 bits of the norm's epsilon and of log2 of RoPE's base). Inputs: rows
# [N * W, (HQ + 2 HKV) * D] (q | k | v heads, lane after lane), q_weight [D], k_weight [D],
# offsets [N] (each lane's first position). Outputs: q [N, HQ, W, D] ([1] without
# WANT_Q), k and v [N, HKV, W, D]. Warp w: row w / (HQ + 2 HKV), head w % (HQ + 2 HKV).
_SOURCE = """
    constexpr int HEADS = HQ + 2 * HKV, HALF = D / 2, PER_LANE = (HALF + 31) / 32;
    const size_t w = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int r = w / HEADS, head = w % HEADS;
    if (r >= rows_shape[0]) return;
    const int n = r / W, t = r % W;
    const T* x = rows + ((size_t)r * HEADS + head) * D;
    if (head >= HQ + HKV) {
        T* out = v + (((size_t)n * HKV + head - HQ - HKV) * W + t) * D;
        for (int d = lane; d < D; d += 32) out[d] = x[d];
        return;
    }
    const bool is_q = head < HQ;
    if (is_q && !WANT_Q) return;
    const T* weight = is_q ? q_weight : k_weight;
    T* out = is_q ? q + (((size_t)n * HQ + head) * W + t) * D : k + (((size_t)n * HKV + head - HQ) * W + t) * D;
    float first[PER_LANE], second[PER_LANE];
    float sum = 0.0f;
    for (int i = 0; i < PER_LANE; ++i) {
        const int p = lane + 32 * i;
        first[i] = second[i] = 0.0f;
        if (p < HALF) {
            first[i] = static_cast<float>(x[TRADITIONAL ? 2 * p : p]);
            second[i] = static_cast<float>(x[TRADITIONAL ? 2 * p + 1 : p + HALF]);
        }
        sum += first[i] * first[i] + second[i] * second[i];
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    const float normalizer = rsqrtf(sum / D + __int_as_float(EPS_BITS));
    const float position = static_cast<float>(offsets[n] + t);
    for (int i = 0; i < PER_LANE; ++i) {
        const int p = lane + 32 * i;
        if (p >= HALF) break;
        const int d0 = TRADITIONAL ? 2 * p : p, d1 = TRADITIONAL ? 2 * p + 1 : p + HALF;
        const float a = static_cast<float>(static_cast<T>(static_cast<float>(weight[d0]) * (first[i] * normalizer)));
        const float b = static_cast<float>(static_cast<T>(static_cast<float>(weight[d1]) * (second[i] * normalizer)));
        const float theta = position * exp2f(-static_cast<float>(p) / HALF * __int_as_float(LOG2_BASE_BITS));
        const float c = cosf(theta), s = sinf(theta);
        out[d0] = static_cast<T>(a * c - b * s);
        out[d1] = static_cast<T>(a * s + b * c);
    }
"""

_kernel = None


def serves(merged: bool, head_dim: int) -> bool:
    """Whether an attention layer's heads fit the kernel: q, k and v merged into one
    projection (`merge_parts`), heads of an even width, on CUDA."""
    return available() and merged and head_dim % 2 == 0


def project_heads(rows: mx.array, q_weight: mx.array, k_weight: mx.array, offsets: mx.array, *, heads: int, kv_heads: int,
                  width: int, eps: float, base: float, traditional: bool,
                  want_q: bool = True) -> tuple[mx.array | None, mx.array, mx.array]:
    """`rows [N * W, (heads + 2 kv_heads) * D]`, a merged q|k|v projection's rows (W =
    `width` per lane, lane after lane) -> q `[N, heads, W, D]` (None unless `want_q`), k and
    v `[N, kv_heads, W, D]`: q and k RMS-normed per head by their weights, then rotated
    by RoPE (all D dims, `base`, split-half pairs unless `traditional`) at position
    `offsets[n] + t` for lane n's row t."""
    global _kernel
    total, lanes = rows.shape[0], offsets.shape[0]
    dim = rows.shape[1] // (heads + 2 * kv_heads)
    if dim % 2 or dim * (heads + 2 * kv_heads) != rows.shape[1]:
        raise ValueError(f"rows of {rows.shape[1]} values are not {heads} + 2 x {kv_heads} heads of an even width")
    if total != lanes * width:
        raise ValueError(f"{total} rows for {lanes} lanes of {width}")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_project_heads", input_names=["rows", "q_weight", "k_weight", "offsets"],
                                      output_names=["q", "k", "v"], source=_SOURCE)
    dtype = rows.dtype
    threads = total * (heads + 2 * kv_heads) * 32
    kv_shape = (lanes, kv_heads, width, dim)
    q, k, v = _kernel(
        inputs=[rows, q_weight.astype(dtype), k_weight.astype(dtype), offsets.astype(mx.int32)],
        template=[("T", dtype), ("D", dim), ("HQ", heads), ("HKV", kv_heads), ("W", width), ("TRADITIONAL", traditional),
                  ("WANT_Q", want_q), ("EPS_BITS", float_bits(eps)), ("LOG2_BASE_BITS", float_bits(math.log2(base)))],
        grid=(-(-threads // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(lanes, heads, width, dim) if want_q else (1,), kv_shape, kv_shape],
        output_dtypes=[dtype, dtype, dtype])
    return (q if want_q else None), k, v

"""Attention of a few query rows per lane over the lane's keys in the KV pool, as one CUDA
kernel.

As MLX operations, a verify window's or a drafter block's attention (2-32 rows per lane,
where the backend's fused kernel would plan per shape, see model.py), a joining lane's
chat prompt read padded to 64 rows (the matmuls again), and a one-row step's
of several lanes (whose masks the fused decoding kernel does not take: on the H200 it
gave way to a batched GEMV, a pointer-array GEMM and their setup, about 90 us of device
time per layer at 16 lanes, bench/results/gpu/session16/kernels-dc633b9), is the pool's keys
read by slot, the queries scaled, the scores, the mask, the softmax, the values and the
copies between them: about six kernels per attention layer, each paid in host time (a
round on the H200 is bound by it). Here one block per lane, KV head and query row
reads the lane's keys and values straight from the pool by its slot, up to the keys its
row may see, and computes the `G` query heads that share the KV head with an online
softmax in float32: warps take the keys 32 at a time (a key per thread for the scores,
a dimension per thread for the values) and merge their partial sums at the end.

Which keys a row sees is all the kernel needs to know of a mask: the target's row `j`
sees positions `<= offset + j` (causal), a drafter's block row sees its context and the
whole block, `< offset + T`. Longer key spans keep the matmuls, whose work spreads over
the whole GPU where this kernel's blocks each walk all of a lane's keys.

Measured on the H200 (bench/results/gpu/session17/): the published drafter's round on the
2.6B shape launches 199 kernels instead of 222 and runs 6-7% faster at 1 and 16 lanes,
side by side; at the engine's level the gain is below the machine's noise. A 16-lane
plain step of the 2.6B shape, its attention by this kernel (22 us of device time per
layer), launched 386 kernels instead of 446 and took 4.00 ms [3.92-4.30] against 5.16
[4.29-5.95] beside the code before (gpu/session18/, which includes the row kernel's
launches of that session).
"""

from __future__ import annotations

import mlx.core as mx

from .cuda import available as available  # re-exported: where this kernel can serve
from .cuda import float_bits

WARPS = 8
MAX_ROWS = 64
MAX_KEYS = 4096

# Template constants: T (dtype), D (head dim, a multiple of 32), G (query heads per KV
# head), CAUSAL, SCALE_BITS (the softmax scale's float32 bits: a constant per model).
# Inputs: q [N, heads, R, D], keys and values [S, kv_heads, capacity, D], slots [N],
# offsets [N]. Output: o [N, R, heads, D]. Block b: lane b / (kv_heads * R), KV head
# (b / R) % kv_heads, query row b % R.
_SOURCE = """
    constexpr int PER_LANE = D / 32, PER_LOAD = 16 / sizeof(T);
    const int heads = q_shape[1], rows = q_shape[2], kv_heads = keys_shape[1], capacity = keys_shape[2];
    const int b = blockIdx.x, j = b % rows, kv = (b / rows) % kv_heads, n = b / (rows * kv_heads);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int seen = offsets[n] + (CAUSAL ? j + 1 : rows);
    const float scale = __int_as_float(SCALE_BITS);
    const size_t pool_row = ((size_t)slots[n] * kv_heads + kv) * capacity;
    const T* key_rows = keys + pool_row * D;
    const T* value_rows = values + pool_row * D;

    __shared__ float q_rows[G * D];
    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
        q_rows[i] = scale * static_cast<float>(q[(((size_t)n * heads + kv * G + i / D) * rows + j) * D + i % D]);
    __syncthreads();

    float m[G], l[G], acc[G][PER_LANE];
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int e = 0; e < PER_LANE; ++e) acc[g][e] = 0.0f;
    }
    for (int base = warp * 32; base < seen; base += WARPS * 32) {
        const int key = base + lane;
        float s[G];
        for (int g = 0; g < G; ++g) s[g] = key < seen ? 0.0f : -INFINITY;
        if (key < seen) {
            const uint4* row = reinterpret_cast<const uint4*>(key_rows + (size_t)key * D);
            for (int c = 0; c < D / PER_LOAD; ++c) {
                const uint4 raw = row[c];
                const T* part = reinterpret_cast<const T*>(&raw);
                for (int u = 0; u < PER_LOAD; ++u) {
                    const float k = static_cast<float>(part[u]);
                    for (int g = 0; g < G; ++g) s[g] += q_rows[g * D + c * PER_LOAD + u] * k;
                }
            }
        }
        float p[G];
        for (int g = 0; g < G; ++g) {
            float top = s[g];
            for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
            const float new_m = fmaxf(m[g], top), kept = expf(m[g] - new_m);
            p[g] = key < seen ? expf(s[g] - new_m) : 0.0f;
            float total = p[g];
            for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffff, total, o);
            l[g] = l[g] * kept + total;
            for (int e = 0; e < PER_LANE; ++e) acc[g][e] *= kept;
            m[g] = new_m;
        }
        const int count = min(32, seen - base);
        for (int t = 0; t < count; ++t) {
            const T* value = value_rows + (size_t)(base + t) * D;
            float v[PER_LANE];
            for (int e = 0; e < PER_LANE; ++e) v[e] = static_cast<float>(value[e * 32 + lane]);
            for (int g = 0; g < G; ++g) {
                const float pt = __shfl_sync(0xffffffff, p[g], t);
                for (int e = 0; e < PER_LANE; ++e) acc[g][e] += pt * v[e];
            }
        }
    }

    // Merge the warps' partial softmaxes (a warp that saw no key holds m = -inf, l = 0).
    __shared__ float warp_m[WARPS * G], warp_l[WARPS * G], warp_acc[WARPS * G * D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) {
            warp_m[warp * G + g] = m[g];
            warp_l[warp * G + g] = l[g];
        }
        for (int e = 0; e < PER_LANE; ++e) warp_acc[(warp * G + g) * D + e * 32 + lane] = acc[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float top = -INFINITY;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w * G + g]);
        float total = 0.0f, sum = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float weight = expf(warp_m[w * G + g] - top);
            total += warp_l[w * G + g] * weight;
            sum += warp_acc[(w * G + g) * D + d] * weight;
        }
        o[(((size_t)n * rows + j) * heads + kv * G + g) * D + d] = static_cast<T>(sum / total);
    }
"""


def serves(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether an attention layer of this geometry fits the kernel (its per-warp partial
    sums in 48 KiB of shared memory)."""
    return available() and head_dim % 32 == 0 and heads % kv_heads == 0 and (WARPS + 1) * heads // kv_heads * head_dim * 4 <= 48 * 1024


def takes(lanes: int, rows: int, keys: int) -> bool:
    """Whether queries of `rows` rows for each of `lanes` lanes over a span of `keys` keys
    take the kernel. One lane's one-row step keeps the backend's fused decoding kernel,
    which spreads a long span over the whole GPU; with several lanes' masks that kernel
    gives way to matmuls (a batched GEMV, a softmax and a pointer-array GEMM per layer),
    which this kernel replaces."""
    return (rows >= 2 or lanes >= 2) and rows <= MAX_ROWS and keys <= MAX_KEYS


_kernel = None


def pool_attention(q: mx.array, keys: mx.array, values: mx.array, slots: mx.array, offsets: mx.array, scale: float,
                   causal: bool) -> mx.array:
    """`softmax(q k^T * scale) v` for queries `q [N, heads, R, D]` over each lane's keys
    and values in the pools `[S, kv_heads, capacity, D]` at its slot `slots[n]`: row `j`
    sees the keys at positions below `offsets[n] + j + 1` (`causal`) or below
    `offsets[n] + R`. Returns `[N, heads, R, D]`, a transposed view of rows
    `[N, R, heads, D]` (what out_proj reads)."""
    global _kernel
    lanes, heads, rows, dim = q.shape
    kv_heads = keys.shape[1]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"the attention kernel takes 1 to {MAX_ROWS} rows per lane, not {rows}")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_pool_attention", input_names=["q", "keys", "values", "slots", "offsets"],
                                      output_names=["o"], source=_SOURCE)
    dtype = q.dtype
    (o,) = _kernel(
        inputs=[q, keys.astype(dtype), values.astype(dtype), slots.astype(mx.int32), offsets.astype(mx.int32)],
        template=[("T", dtype), ("D", dim), ("G", heads // kv_heads), ("CAUSAL", causal), ("WARPS", WARPS),
                  ("SCALE_BITS", float_bits(scale))],
        grid=(lanes * kv_heads * rows * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(lanes, rows, heads, dim)], output_dtypes=[dtype])
    return o.transpose(0, 2, 1, 3)

"""A few rows times a large weight, `x [M, K] @ w[N, K].T` for 2 <= M <= 32, as one CUDA kernel.

MLX 0.32's CUDA backend multiplies more than one row through cuBLASLt and builds the
GEMM's descriptors and asks its heuristic on every call: tens of microseconds of host
time per matmul, over a hundred matmuls per step of a released model's shape, so a
16-lane step or a 9-row verify is bound by its launches, not by reading the weights
(bench/results/README.md, "The H200 runs"). Here each warp reads COLS rows of the weight
once, 16 bytes per thread per step along K, and multiplies them into every one of the M
rows (read through the L1 cache, where they stay: M x K is small), accumulating in
float32; a warp-wide sum finishes each output. The launch is a kernel node and nothing
else. Shapes are read at run time, so one compiled kernel per dtype and row bucket
serves every map of a model.
"""

from __future__ import annotations

import mlx.core as mx

WARPS = 4  # per block
MAX_ROWS = 32
VECTOR = 8  # elements per 16-byte load of bf16 / fp16 (two loads for float32)

_HEADER = """
__device__ __forceinline__ void load8(const float* p, float* out) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
    #pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = __bfloat1622float2(pairs[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void load8(const __half* p, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
    #pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 f = __half22float2(pairs[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
"""

# Template constants: ROWS (a bound on M), COLS (weight rows per warp), WARPS.
_SOURCE = """
    const int m_rows = x_shape[0], k_len = x_shape[1], n_len = w_shape[0];
    const int lane = threadIdx.x % 32;
    const int n0 = (blockIdx.x * WARPS + threadIdx.x / 32) * COLS;
    if (n0 >= n_len) return;
    float acc[COLS][ROWS];
    #pragma unroll
    for (int c = 0; c < COLS; ++c)
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) acc[c][m] = 0.0f;
    for (int k = lane * 8; k < k_len; k += 32 * 8) {
        float wv[COLS][8];
        #pragma unroll
        for (int c = 0; c < COLS; ++c)
            if (n0 + c < n_len) load8(w + (size_t)(n0 + c) * k_len + k, wv[c]);
            else for (int i = 0; i < 8; ++i) wv[c][i] = 0.0f;
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            if (m < m_rows) {
                float xv[8];
                load8(x + (size_t)m * k_len + k, xv);
                #pragma unroll
                for (int c = 0; c < COLS; ++c)
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[c][m] = fmaf(wv[c][i], xv[i], acc[c][m]);
            }
        }
    }
    #pragma unroll
    for (int c = 0; c < COLS; ++c)
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) {
            if (m < m_rows) {
                float v = acc[c][m];
                #pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
                if (lane == 0 && n0 + c < n_len) y[(size_t)m * n_len + n0 + c] = static_cast<Y>(v);
            }
        }
"""


def available() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def serves(weight: mx.array) -> bool:
    """Whether the kernel can multiply rows by `weight`: a plain 2-D float weight whose
    rows are a whole number of 16-byte loads."""
    return weight.ndim == 2 and weight.dtype in (mx.bfloat16, mx.float16, mx.float32) and weight.shape[1] % VECTOR == 0


def row_bucket(rows: int) -> tuple[int, int]:
    """(ROWS, COLS) for M rows: the accumulators are COLS x ROWS floats per thread."""
    if rows <= 8:
        return 8, 4
    if rows <= 16:
        return 16, 2
    return MAX_ROWS, 1


_kernel = None


def rows_times_weight(x: mx.array, weight: mx.array) -> mx.array:
    """`x @ weight.T` for `x [M, K]` (2 <= M <= MAX_ROWS) and `weight [N, K]`, both of one dtype."""
    global _kernel
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the row kernel multiplies 1 to {MAX_ROWS} rows, not {x.shape[0]}")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_rows_times_weight", input_names=["x", "w"], output_names=["y"],
                                      source=_SOURCE, header=_HEADER)
    rows, n = x.shape[0], weight.shape[0]
    bucket, cols = row_bucket(rows)
    per_block = WARPS * cols
    (y,) = _kernel(
        inputs=[x.astype(weight.dtype), weight],
        template=[("Y", weight.dtype), ("ROWS", bucket), ("COLS", cols), ("WARPS", WARPS)],
        grid=(-(-n // per_block) * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[weight.dtype])
    return y

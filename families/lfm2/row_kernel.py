"""A few rows times a large weight, `x [M, K] @ w[N, K].T` for 1 <= M <= 16, as one CUDA kernel.

MLX 0.32's CUDA backend multiplies more than one row through cuBLASLt and builds the
GEMM's descriptors and asks its heuristic on every call: host time per matmul that a
16-lane step or a 9-row verify of a released model's shape pays over a hundred times
(bench/results/README.md, "The H200 runs"). This kernel is a plain launch. It runs on the
tensor cores (`mma.sync` m16n8k16, bfloat16 or float16 in, float32 sums): a block owns
8 columns of the output (8 rows of the weight) per tile for all M rows, padded to one
tile of 16 rows; its warps take turns along K in chunks of 32, each thread loading 16
bytes of a weight row and of two rows of x per chunk, and the warps' partial sums are
added in a fixed order at the end, so a product never depends on how many rows came with it.

How many warps a block has, how many weight loads each thread keeps in flight, how many
tiles of 8 weight rows a block owns and where a warp's loads lie along K is the launch
(`Launch`), a function of the weight's shape alone (`launch_for`). Measured one product at
a time in device time on the H200 (`bench.row_launches`, bench/results/gpu/session20/):
a 2.6B step's 121 products for 9 rows take 1.85 ms with `launch_for`'s launches, against
1.98 with session 18's rule and 1.84 with the fastest launch for each shape. MLX's matmul
takes 1.74 ms of device time and its one-row GEMV 1.58, so this kernel still reads weights
slower than both (3.25 TB/s at 9 rows on the 21504 x 2048 gate-and-up weight, against 4.0
for the GEMV); what it saves is cuBLASLt's host time, for which the engine decoded 1.60x
and 1.74x faster at 8 and 16 lanes on the 2.6B shape (`bench_target --cublas`,
gpu/session20/).

Inside a chunk the mma's 16 positions of K are mapped onto the thread's contiguous 8
elements (logical k = 2t + e and 8 + 2t + e, t = lane % 4, are physical 8t + e and
8t + 2 + e, then 8t + 4 + e and 8t + 6 + e for the chunk's second mma): the same map for
x and for the weight leaves each dot product unchanged and lets every load be one vector.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from .cuda import available as available  # re-exported: where this kernel can serve

WARPS = 8  # per block, along K
MAX_ROWS = 16  # one tile of the mma's 16 rows
VECTOR = 8  # elements per 16-byte load

MMA_HEADER = """
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// One chunk's two mmas for the 16-row tile: `lo` holds row g's 8 elements, `hi` row g + 8's, `w` the weight row's.
template <bool BF16>
__device__ __forceinline__ void chunk(float* c, const uint4& lo, const uint4& hi, const uint4& w) {
    if (BF16) {
        mma_bf16(c, lo.x, hi.x, lo.y, hi.y, w.x, w.y);
        mma_bf16(c, lo.z, hi.z, lo.w, hi.w, w.z, w.w);
    } else {
        mma_f16(c, lo.x, hi.x, lo.y, hi.y, w.x, w.y);
        mma_f16(c, lo.z, hi.z, lo.w, hi.w, w.z, w.w);
    }
}
"""

# Template constants: BF16, Y (the output type), and the launch (`Launch`): WARPS, DEPTH,
# TILES, ADJACENT. A weight is read once, so it is loaded evict-first (`__ldcs`), leaving
# the cache to the rows of x that every block reads.
_SOURCE = """
    __shared__ float partial[WARPS][TILES][4][32];
    const int m_rows = x_shape[0], k_len = x_shape[1], n_len = w_shape[0];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int n0 = blockIdx.x * 8 * TILES + g;  // the weight row this thread loads for tile 0; tile i's is n0 + 8i
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[TILES][4] = {};
    // A block covers WARPS * DEPTH chunks of 32 elements of K an iteration. A warp's DEPTH
    // chunks lie side by side (ADJACENT: a run of 64 * DEPTH bytes of each weight row) or
    // WARPS chunks apart. Each thread loads its weights for all of them before multiplying
    // any, so that many loads are in flight; the chunks are still summed in order of K.
    const int first = (ADJACENT ? warp * DEPTH : warp) * 32, apart = ADJACENT ? 32 : WARPS * 32;
    #pragma unroll 2
    for (int start = first; start < k_len; start += WARPS * DEPTH * 32) {
        uint4 wv[DEPTH][TILES];
        #pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int k = start + d * apart + t * 8;
            #pragma unroll
            for (int i = 0; i < TILES; ++i) {
                const int n = n0 + 8 * i;
                wv[d][i] = (k < k_len && n < n_len) ? __ldcs(reinterpret_cast<const uint4*>(w + (size_t)n * k_len + k)) : zero;
            }
        }
        #pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int k = start + d * apart + t * 8;
            const bool in_k = k < k_len;
            const uint4 lo = (in_k && g < m_rows) ? *reinterpret_cast<const uint4*>(x + (size_t)g * k_len + k) : zero;
            const uint4 hi = (in_k && g + 8 < m_rows) ? *reinterpret_cast<const uint4*>(x + (size_t)(g + 8) * k_len + k) : zero;
            // One load of x serves every tile: TILES weight tiles per load of a row of x.
            #pragma unroll
            for (int i = 0; i < TILES; ++i) chunk<BF16>(acc[i], lo, hi, wv[d][i]);
        }
    }
    #pragma unroll
    for (int i = 0; i < TILES; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) partial[warp][i][j][lane] = acc[i][j];
    __syncthreads();
    if (warp != 0) return;
    #pragma unroll
    for (int i = 0; i < TILES; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            float sum = 0.0f;
            for (int v = 0; v < WARPS; ++v) sum += partial[v][i][j][lane];
            // c0, c1: row g, columns 2t and 2t + 1 of the tile's 8; c2, c3: row g + 8.
            const int row = g + (j >= 2 ? 8 : 0), col = blockIdx.x * 8 * TILES + 8 * i + 2 * t + (j & 1);
            if (row < m_rows && col < n_len) y[(size_t)row * n_len + col] = static_cast<Y>(sum);
        }
"""


@dataclass(frozen=True)
class Launch:
    """How the kernel is launched for a weight: warps per block (along K), weight loads in
    flight per thread, tiles of 8 weight rows per block (each load of x serves them all),
    and whether a warp's loads lie side by side along K (ADJACENT) or a block's width apart."""

    warps: int = WARPS
    depth: int = 1
    tiles: int = 1
    adjacent: bool = False


# What `bench.row_launches` measures. At most 4 loads in flight per thread, and not 32
# warps with 4 (more registers than such a block may have).
LAUNCHES = tuple(Launch(w, d, i, a) for w in (4, 8, 16, 32)
                 for d, i, a in ((1, 1, False), (2, 1, False), (2, 1, True), (4, 1, True), (1, 2, False), (2, 2, False), (2, 2, True))
                 if w * d * i <= 64)


# Warps in all that a product's launch aims at, about 70% of what the H200's 132 SMs hold
# (64 each), and the length of a weight row from which a warp's loads lie side by side.
# Measured per weight shape of the 2.6B step in device time (bench/results/gpu/session19/
# row-launches-2.6b.md): 2048 and 3072 columns ran fastest with 16 warps a block (4,096
# and 6,144 in all), 6144 with 8, wider weights with 4; rows of 10752 with a warp's loads
# side by side, rows of 2048 (mostly) a block's width apart; two loads in flight and the
# evict-first hint (session 18) took another 3-6% off the step's products.
WARPS_IN_ALL = 6144
ADJACENT_FROM_K = 4096


@functools.cache  # asked for every product of every step, of a few weight shapes
def launch_for(n: int, k: int) -> Launch:
    """The launch for a weight of `n` rows of `k` (the product's columns and its inner
    length): a function of the weight alone, so a row's product does not depend on how
    many rows come with it."""
    blocks, warps = -(-n // 8), 16
    while warps > 4 and blocks * warps > WARPS_IN_ALL:
        warps //= 2
    return Launch(warps, depth=2, adjacent=k >= ADJACENT_FROM_K)


def serves(weight: mx.array) -> bool:
    """Whether the kernel can multiply rows by `weight`: a plain 2-D bfloat16 or float16
    weight (the tensor cores' inputs; float32 stays exact with MLX's own matmul) whose rows
    are a whole number of 16-byte loads."""
    return weight.ndim == 2 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % VECTOR == 0


_kernel = None


def rows_times_weight(x: mx.array, weight: mx.array, launch: Launch | None = None) -> mx.array:
    """`x @ weight.T` for `x [M, K]` (1 <= M <= MAX_ROWS) and `weight [N, K]`, both of one
    dtype, launched as `launch` says (by default `launch_for` the weight)."""
    global _kernel
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"the row kernel multiplies 1 to {MAX_ROWS} rows, not {x.shape[0]}")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_rows_times_weight", input_names=["x", "w"], output_names=["y"],
                                      source=_SOURCE, header=MMA_HEADER)
    rows, n = x.shape[0], weight.shape[0]
    launch = launch or launch_for(*weight.shape)
    (y,) = _kernel(
        inputs=[x.astype(weight.dtype), weight],
        template=[("Y", weight.dtype), ("BF16", weight.dtype == mx.bfloat16),
                  ("WARPS", launch.warps), ("DEPTH", launch.depth),
                  ("TILES", launch.tiles), ("ADJACENT", launch.adjacent)],
        grid=(-(-n // (8 * launch.tiles)) * launch.warps * 32, 1, 1), threadgroup=(launch.warps * 32, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[weight.dtype])
    return y

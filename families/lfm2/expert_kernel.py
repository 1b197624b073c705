"""A few rows times their chosen experts, `y[r, j] = x[r] @ w[chosen[r, j]].T`, as one CUDA kernel.

A mixture-of-experts layer multiplies each of R rows by k of E experts' weights. MLX
0.32's CUDA backend does that as `gather_mm`: to read each expert's weight once, the
(row, expert) pairs are sorted by expert, the rows gathered into that order, multiplied by
a grouped GEMM (CUTLASS, built for groups of many rows, where a decode step brings one or
two rows per expert), and the products put back in row order: five or more launches per
product. This kernel takes the rows and the router's choices as they are. A block owns 8
rows of one expert's weight (blockIdx.y is the expert); its 256 threads first find, by a
ballot over `chosen`, the pairs routed to that expert (at most 16: a row chooses an expert
once, so at most R <= 16 rows), and blocks of experts no row chose end there. The rest is
`row_kernel`'s tile: the tensor cores (`mma.sync` m16n8k16) over the pairs' rows, 8 warps
along K, partial sums added in a fixed order, so a pair's product does not depend on
which other rows came with it. Each weight is read once by the blocks that need it.

Measured on the H200 (bench/results/gpu/session14/), the LFM2-8B-A1B shape's 22 MoE layers:
a pass over 16 rows took 5.2 ms against gather_mm's 22.3 (its sorted, grouped path), 8
rows 1.11x faster than gather_mm's unsorted path, 2-4 rows level with it, one row 0.79x
its GEMV: so serving takes the kernel for 2-16 rows (`families.lfm2.model.Experts`).

`X_PER_PAIR`: 0 when the rows are the layer's inputs `x [R, K]`, shared by a row's k pairs
(the first product), 1 when there is a row per pair, `x [R * k, K]` (the second, after
the gated activation). The output has a row per pair, `[R * k, N]`, pair `r * k + j`.
"""

from __future__ import annotations

import mlx.core as mx

from .cuda import available as available  # re-exported: where this kernel can serve
from .row_kernel import MMA_HEADER, VECTOR, WARPS

MAX_ROWS = 16  # rows of x (one 16-row tile per expert)
MAX_PAIRS = WARPS * 32  # one ballot lane per (row, expert) pair

# Template constants: BF16, WARPS, X_PER_PAIR, Y (the output type).
_SOURCE = """
    __shared__ float partial[WARPS][4][32];
    __shared__ int pairs[16];
    __shared__ int found[WARPS];
    const int expert = blockIdx.y, pair_count = chosen_shape[0] * chosen_shape[1], per_row = chosen_shape[1];
    const int k_len = w_shape[2], n_len = w_shape[1];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    // The pairs routed to this expert, in pair order: a ballot per warp, then each warp's offset.
    const bool mine = threadIdx.x < pair_count && chosen[threadIdx.x] == expert;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) found[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, count = 0;
    for (int v = 0; v < WARPS; ++v) {
        before += v < warp ? found[v] : 0;
        count += found[v];
    }
    const int slot = before + __popc(ballot & ((1u << lane) - 1u));
    if (mine && slot < 16) pairs[slot] = threadIdx.x;  // more than 16 only if a row chose an expert twice
    if (count == 0) return;  // uniform across the block: no row chose this expert
    __syncthreads();

    const int n = blockIdx.x * 8 + g;  // the weight row this thread loads
    const auto* w_row = w + ((size_t)expert * n_len + n) * k_len;
    const int lo_pair = g < count ? pairs[g] : -1, hi_pair = g + 8 < count ? pairs[g + 8] : -1;
    const auto* x_lo = x + (size_t)(lo_pair < 0 ? 0 : (X_PER_PAIR ? lo_pair : lo_pair / per_row)) * k_len;
    const auto* x_hi = x + (size_t)(hi_pair < 0 ? 0 : (X_PER_PAIR ? hi_pair : hi_pair / per_row)) * k_len;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    #pragma unroll 4
    for (int k = (warp * 4 + t) * 8; k - t * 8 < k_len; k += WARPS * 32) {
        const bool in_k = k < k_len;
        const uint4 wv = (in_k && n < n_len) ? *reinterpret_cast<const uint4*>(w_row + k) : zero;
        const uint4 lo = (in_k && lo_pair >= 0) ? *reinterpret_cast<const uint4*>(x_lo + k) : zero;
        const uint4 hi = (in_k && hi_pair >= 0) ? *reinterpret_cast<const uint4*>(x_hi + k) : zero;
        chunk<BF16>(acc, lo, hi, wv);
    }
    #pragma unroll
    for (int j = 0; j < 4; ++j) partial[warp][j][lane] = acc[j];
    __syncthreads();
    if (warp != 0) return;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float sum = 0.0f;
        for (int v = 0; v < WARPS; ++v) sum += partial[v][j][lane];
        // c0, c1: tile row g, columns 2t and 2t + 1 of the block's 8; c2, c3: tile row g + 8.
        const int pair = j >= 2 ? hi_pair : lo_pair, col = blockIdx.x * 8 + 2 * t + (j & 1);
        if (pair >= 0 && col < n_len) y[(size_t)pair * n_len + col] = static_cast<Y>(sum);
    }
"""


def serves(weight: mx.array, rows: int, per_row: int) -> bool:
    """Whether the kernel can multiply `rows` rows, `per_row` experts each, by the stacked
    experts `weight [E, N, K]`: bfloat16 or float16 (the tensor cores' inputs), rows of
    whole 16-byte loads, at most MAX_ROWS rows and a ballot lane for every pair."""
    return (weight.ndim == 3 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[2] % VECTOR == 0
            and 1 <= rows <= MAX_ROWS and rows * per_row <= MAX_PAIRS)


_kernel = None


def rows_times_experts(x: mx.array, weight: mx.array, chosen: mx.array) -> mx.array:
    """`[R * k, N]`: row `r * k + j` is `x[r] @ weight[chosen[r, j]].T` (x `[R, K]`), or
    `x[r * k + j] @ weight[chosen[r, j]].T` when x has a row per pair (`[R * k, K]`).
    `chosen [R, k]` holds distinct experts per row (a router's top k)."""
    global _kernel
    rows, per_row = chosen.shape
    if not serves(weight, rows, per_row):
        raise ValueError(f"the expert kernel multiplies 1 to {MAX_ROWS} rows of bfloat16 or float16 by "
                         f"experts [E, N, K] with K a multiple of {VECTOR}, not {rows} rows x {per_row} "
                         f"experts by {weight.dtype} {tuple(weight.shape)}")
    if x.shape[0] not in (rows, rows * per_row):
        raise ValueError(f"{x.shape[0]} rows of x for {rows} rows of {per_row} experts each")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_rows_times_experts", input_names=["x", "w", "chosen"],
                                      output_names=["y"], source=_SOURCE, header=MMA_HEADER)
    experts, n, _ = weight.shape
    (y,) = _kernel(
        inputs=[x.astype(weight.dtype), weight, chosen.astype(mx.int32)],
        template=[("Y", weight.dtype), ("BF16", weight.dtype == mx.bfloat16), ("WARPS", WARPS),
                  ("X_PER_PAIR", int(x.shape[0] == rows * per_row and per_row > 1))],
        grid=(-(-n // 8) * WARPS * 32, experts, 1), threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows * per_row, n)], output_dtypes=[weight.dtype])
    return y

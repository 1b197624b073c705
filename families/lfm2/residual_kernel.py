"""A residual add and the RMSNorm after it, as one CUDA kernel.

Every layer of the target adds its operator's output to the residual stream and norms the
sum for its feed-forward, then adds the feed-forward's output and norms that for the next
layer: as MLX operations an add and a norm each, four kernels per layer (two per DSpark
drafter layer's half), each paid in host time (a round on the H200 is bound by it, not
by the arithmetic). Here one block per row adds the two rows in float32, rounds the sum
to the model's dtype (as the add does), keeps it, and norms it in float32 from the rounded
values, rounding once more: the sum and the normed row in one launch.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .cuda import available as available  # re-exported: where this kernel can serve
from .cuda import float_bits

THREADS = 256

# Template constants: T (dtype), H (row width), PER_THREAD (values of a row per thread), EPS_BITS.
# Inputs: h and r [R, H], weight [H]. Outputs: total = h + r and normed [R, H]. Block b: row b.
_SOURCE = """
    constexpr int hidden = H;
    const size_t row = (size_t)blockIdx.x * hidden;
    float values[PER_THREAD];
    float sum = 0.0f;
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        values[i] = 0.0f;
        if (c < hidden) {
            const T added = static_cast<T>(static_cast<float>(h[row + c]) + static_cast<float>(r[row + c]));
            total[row + c] = added;
            values[i] = static_cast<float>(added);
        }
        sum += values[i] * values[i];
    }
    __shared__ float partial[32];
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o /= 2) t += __shfl_xor_sync(0xffffffff, t, o);
        if (threadIdx.x == 0) partial[0] = t;
    }
    __syncthreads();
    const float normalizer = rsqrtf(partial[0] / hidden + __int_as_float(EPS_BITS));
    for (int i = 0; i < PER_THREAD; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < hidden) normed[row + c] = static_cast<T>(static_cast<float>(weight[c]) * (values[i] * normalizer));
    }
"""

_kernel = None


def add_rms_norm(h: mx.array, r: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """`h + r` and its RMSNorm by `weight` (`[..., H]` rows each), in one launch."""
    global _kernel
    if h.shape != r.shape or weight.shape != h.shape[-1:]:
        raise ValueError(f"rows {h.shape} and {r.shape} with a weight of {weight.shape} do not add and norm")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_add_rms_norm", input_names=["h", "r", "weight"],
                                      output_names=["total", "normed"], source=_SOURCE)
    dtype, hidden = h.dtype, h.shape[-1]
    rows = h.size // hidden
    total, normed = _kernel(
        inputs=[h, r.astype(dtype), weight.astype(dtype)],
        template=[("T", dtype), ("H", hidden), ("PER_THREAD", -(-hidden // THREADS)), ("EPS_BITS", float_bits(eps))],
        grid=(rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[h.shape, h.shape], output_dtypes=[dtype, dtype])
    return total, normed


def add_norm(h: mx.array, r: mx.array, norm: nn.RMSNorm, by_kernel: bool) -> tuple[mx.array, mx.array]:
    """`(h + r, norm(h + r))`: one kernel where `by_kernel` (CUDA), else an add and the norm."""
    if by_kernel:
        return add_rms_norm(h, r, norm.weight, norm.eps)
    total = h + r
    return total, norm(total)

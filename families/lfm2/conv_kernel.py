"""An LFM2 conv layer's gated short conv over a round's rows, as one CUDA kernel.

As MLX operations, `B, C, X = split(in_proj(x))`, `y = C * conv(concat(state, B * X))`
over W rows per lane is a gather of the lanes' states, a product, a concatenation (a copy
per part), the conv's fused multiply-adds, another product and, in a one-row round, the
update of the pool with each lane's row kept: six or seven kernels per conv layer, each
paid in host time (a round on the H200 is bound by it, not by the arithmetic). Here one
thread per lane and channel reads the lane's state from the pool by its slot, forms the
window `[state ; B * X]` (rounded to the model's dtype, as the product is), runs the conv
in float32, rounds it, gates it by C and writes the gated rows and the window (what
commit rebuilds the state from after a partial accept); in a one-row round it also
writes the pool with each lane's row kept, the other slots copied as they are. The
arithmetic per row does not depend on how many rows come with it, so a verify's rows
and a one-row step's agree.

Once a round of several rows is accepted, `kept_states` rebuilds every conv layer's pool
from its window in one launch, where `take_along_axis` and a scatter per layer took two
kernels each.
"""

from __future__ import annotations

import mlx.core as mx

from .cuda import available as available  # re-exported: where this kernel can serve

THREADS = 256

# Template constants: W (rows per lane), L (conv taps), KEEP (one-row round: write the kept
# pool), HAS_BIAS, T (the dtype). Inputs: z [N*W, 3H] (B | C | X), pool [S, L-1, H],
# slots [N], weight [H, L], bias [H] (unread without HAS_BIAS).
_SOURCE = """
    const int hidden = pool_shape[2], slot_count = pool_shape[0], lanes = slots_shape[0];
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int h = i % hidden, r = i / hidden;
    if (r < lanes) {
        const int slot = slots[r];
        float window[L - 1 + W];
        for (int j = 0; j < L - 1; ++j) window[j] = static_cast<float>(pool[((size_t)slot * (L - 1) + j) * hidden + h]);
        for (int t = 0; t < W; ++t) {
            const T* row = z + (size_t)(r * W + t) * 3 * hidden;
            window[L - 1 + t] = static_cast<float>(static_cast<T>(static_cast<float>(row[h]) * static_cast<float>(row[2 * hidden + h])));
        }
        for (int j = 0; j < L - 1 + W; ++j) windows[((size_t)r * (L - 1 + W) + j) * hidden + h] = static_cast<T>(window[j]);
        float taps[L];
        for (int k = 0; k < L; ++k) taps[k] = static_cast<float>(weight[h * L + k]);
        for (int t = 0; t < W; ++t) {
            float sum = HAS_BIAS ? static_cast<float>(bias[h]) : 0.0f;
            for (int k = 0; k < L; ++k) sum += taps[k] * window[t + k];
            const float gate = static_cast<float>(z[(size_t)(r * W + t) * 3 * hidden + hidden + h]);
            y[(size_t)(r * W + t) * hidden + h] = static_cast<T>(gate * static_cast<float>(static_cast<T>(sum)));
        }
        if (KEEP)
            for (int j = 0; j < L - 1; ++j) kept[((size_t)slot * (L - 1) + j) * hidden + h] = static_cast<T>(window[W + j]);
    }
    if (KEEP && r < slot_count) {
        bool in_round = false;
        for (int n = 0; n < lanes; ++n) in_round |= slots[n] == r;
        if (!in_round)
            for (int j = 0; j < L - 1; ++j) kept[((size_t)r * (L - 1) + j) * hidden + h] = pool[((size_t)r * (L - 1) + j) * hidden + h];
    }
"""

# A thread holds its lane's window of L - 1 + W rows. Up to 64 rows per lane, a chat
# prompt's read as the engine pads it, take the kernel (its window spills from registers
# to local memory past about 32 rows, which costs the GPU less than the six or seven
# operations cost the host); longer prompt chunks take the operations.
MAX_ROWS = 64


_kernel = None


def gated_conv(z: mx.array, pool: mx.array, slots: mx.array, weight: mx.array, bias: mx.array | None,
               width: int, keep: bool) -> tuple[mx.array, mx.array, mx.array | None]:
    """`z [N * W, 3H]` (in_proj's B | C | X rows, lane after lane, W = `width` each), the
    conv pool `[S, L-1, H]`, the lanes' slots `[N]`, the conv's taps `[H, L]` -> the
    gated rows `C * conv(window)` `[N * W, H]`, the windows `[N, L-1+W, H]` and, with
    `keep` (one-row rounds), the pool with each lane's row kept."""
    global _kernel
    if not 1 <= width <= MAX_ROWS:
        raise ValueError(f"the conv kernel takes 1 to {MAX_ROWS} rows per lane, not {width}")
    if keep and width != 1:
        raise ValueError("only a one-row round keeps its rows in the kernel")
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="laneserve_gated_conv", input_names=["z", "pool", "slots", "weight", "bias"],
                                      output_names=["y", "windows", "kept"], source=_SOURCE)
    lanes, hidden = slots.shape[0], pool.shape[2]
    taps = weight.shape[1]
    dtype = z.dtype
    threads = max(lanes, pool.shape[0] if keep else 0) * hidden
    outputs = _kernel(
        # Without a bias the taps stand in for it, unread: a zeros array would be a fill
        # kernel of its own in every compiled segment.
        inputs=[z, pool.astype(dtype), slots.astype(mx.int32), weight.astype(dtype),
                (bias if bias is not None else weight).astype(dtype)],
        template=[("T", dtype), ("W", width), ("L", taps), ("KEEP", keep), ("HAS_BIAS", bias is not None)],
        grid=(-(-threads // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(lanes * width, hidden), (lanes, taps - 1 + width, hidden), pool.shape if keep else (1,)],
        output_dtypes=[dtype, dtype, dtype])
    y, windows, kept = outputs
    return y, windows, kept if keep else None


# Template constants: LAYERS, L, T. Inputs: window0.. [N, L-1+W, H], pool0.. [S, L-1, H],
# slots [N], kept [N] (rows each lane keeps); outputs: state0.. [S, L-1, H]. blockIdx.y picks
# the layer.
_KEPT_SOURCE = """
    const int hidden = pool0_shape[2], slot_count = pool0_shape[0], lanes = slots_shape[0], rows = window0_shape[1];
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int h = i % hidden, r = i / hidden;
    const T* window;
    const T* pool;
    T* state;
    switch (blockIdx.y) {
CASES
    }
    if (r < lanes) {
        const int slot = slots[r], start = kept[r];
        for (int j = 0; j < L - 1; ++j)
            state[((size_t)slot * (L - 1) + j) * hidden + h] = window[((size_t)r * rows + start + j) * hidden + h];
    }
    if (r < slot_count) {
        bool in_round = false;
        for (int n = 0; n < lanes; ++n) in_round |= slots[n] == r;
        if (!in_round)
            for (int j = 0; j < L - 1; ++j) state[((size_t)r * (L - 1) + j) * hidden + h] = pool[((size_t)r * (L - 1) + j) * hidden + h];
    }
"""

_kept_kernels: dict[int, object] = {}


def kept_states(windows: list[mx.array], pools: list[mx.array], slots: mx.array, kept: mx.array) -> list[mx.array]:
    """Each conv layer's pool once lane n keeps `kept[n]` of its rows: the state after
    them is window rows `kept[n] .. kept[n] + L-2`, at the lane's slot `slots[n]`; the
    other slots' states as they were. `windows` and `pools` are per layer."""
    layers = len(windows)
    if layers not in _kept_kernels:
        cases = "\n".join(f"        case {j}: window = window{j}; pool = pool{j}; state = state{j}; break;" for j in range(layers))
        _kept_kernels[layers] = mx.fast.cuda_kernel(
            name=f"laneserve_conv_kept_{layers}",
            input_names=[*(f"window{j}" for j in range(layers)), *(f"pool{j}" for j in range(layers)), "slots", "kept"],
            output_names=[f"state{j}" for j in range(layers)], source=_KEPT_SOURCE.replace("CASES", cases))
    dtype = windows[0].dtype
    lanes, hidden = slots.shape[0], pools[0].shape[2]
    threads = max(lanes, pools[0].shape[0]) * hidden
    return _kept_kernels[layers](
        inputs=[*windows, *(pool.astype(dtype) for pool in pools), slots.astype(mx.int32), kept.astype(mx.int32)],
        template=[("T", dtype), ("L", pools[0].shape[1] + 1)],
        grid=(-(-threads // THREADS) * THREADS, layers, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[pool.shape for pool in pools], output_dtypes=[dtype] * layers)

"""The greedy Markov chain of a proposal as CUDA kernels: one for a small head, g + 1 for a large one.

Greedy, the chain `l_k = U_k + w2(w1[x_k])`, `x_{k+1} = argmax l_k` is g dependent steps
of a gather, a rank-R product, an add and an argmax: about six launches per step as MLX
operations, which on a GPU cost host time per launch (the round is bound by it, not by
the arithmetic). Here one block per lane runs all g steps: it holds `w1[x_k]` in shared
memory, each thread scores a strided share of the vocabulary, and a block reduction
takes the argmax (the lowest id among equal scores, as `mx.argmax` does). The scores
add the rank-R product in float32 where the operations round it to the weights' dtype
first, so a near-tie may pick differently: a proposal only steers which rows are
verified, never what is emitted.

A released drafter's head (65536 x 256) is too large for one block per lane. There,
`StepwiseGreedyChain` runs each step as one launch over the whole vocabulary: every
block takes a slice of it for every lane and leaves each lane's best score and id in
its slice; the next step's blocks each reduce those to the token they continue from (so
no launch of its own takes the argmax), and a last launch reduces every step's to the
tokens. g + 1 launches where the operations took about six per step.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

THREADS = 256
# One block per lane scores the whole vocabulary at every step, so the kernel serves small
# heads only: the embedded default's is 4096 x 64 (2^18 weights); a released drafter's
# (65536 x 256) kept one block busy for 140 ms a round on the H200, against 4 ms for the
# operations.
MAX_HEAD_WEIGHTS = 1 << 20

_SOURCE = """
    __shared__ float e[R];
    __shared__ float best_score[THREADS];
    __shared__ int best_id[THREADS];
    __shared__ int prev;
    const int lane = blockIdx.x, t = threadIdx.x;
    if (t == 0) prev = anchors[lane];
    __syncthreads();
    for (int k = 0; k < G; ++k) {
        for (int r = t; r < R; r += THREADS) e[r] = w1[(size_t)prev * R + r];
        __syncthreads();
        const float* u = base + ((size_t)lane * G + k) * V;
        float top = -INFINITY;
        int at = V;
        for (int v = t; v < V; v += THREADS) {
            float score = 0.0f;
            for (int r = 0; r < R; ++r) score += w2t[(size_t)r * V + v] * e[r];
            score += u[v];
            if (score > top) { top = score; at = v; }  // v rises: the first of equals stays
        }
        best_score[t] = top;
        best_id[t] = at;
        __syncthreads();
        for (int s = THREADS / 2; s > 0; s >>= 1) {
            if (t < s) {
                float other = best_score[t + s];
                int other_id = best_id[t + s];
                if (other > best_score[t] || (other == best_score[t] && other_id < best_id[t])) {
                    best_score[t] = other;
                    best_id[t] = other_id;
                }
            }
            __syncthreads();
        }
        if (t == 0) {
            prev = best_id[0] < V ? best_id[0] : 0;  // no finite score: the lane's faults say so
            tokens[(size_t)lane * G + k] = prev;
        }
        __syncthreads();
    }
"""


def cuda_chain_available() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


class FusedGreedyChain:
    """`(U [N, g, V], anchors [N]) -> tokens [N, g] int32` for a small Markov head of
    plain (unquantized) weights, on CUDA. Keeps float32 copies of `w1` and of `w2` transposed
    (rank x vocabulary, so that neighbouring threads read neighbouring scores)."""

    def __init__(self, markov_w1: nn.Module, markov_w2: nn.Module):
        self.w1 = markov_w1.weight.astype(mx.float32)
        self.w2t = mx.contiguous(markov_w2.weight.astype(mx.float32).T)
        self.vocab, self.rank = self.w1.shape
        mx.eval(self.w1, self.w2t)
        self.kernel = mx.fast.cuda_kernel(name="dspark_greedy_chain", input_names=["base", "anchors", "w1", "w2t"],
                                          output_names=["tokens"], source=_SOURCE, header=f"#define THREADS {THREADS}\n")

    @staticmethod
    def serves(markov_w1: nn.Module, markov_w2: nn.Module) -> bool:
        """Whether the head's weights are plain arrays the kernel can read, and few
        enough for one block per lane."""
        plain = all("weight" in m and "scales" not in m for m in (markov_w1, markov_w2))
        return plain and "bias" not in markov_w2 and markov_w2.weight.size <= MAX_HEAD_WEIGHTS

    def __call__(self, base: mx.array, anchors: mx.array) -> mx.array:
        lanes, width, vocab = base.shape
        (tokens,) = self.kernel(
            inputs=[base.astype(mx.float32), anchors.astype(mx.int32), self.w1, self.w2t],
            template=[("V", vocab), ("R", self.rank), ("G", width)],
            grid=(lanes * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(lanes, width)], output_dtypes=[mx.int32])
        return tokens


# Blocks of a step take VOCAB_PER_THREAD * THREADS ids each, for every lane of the round.
VOCAB_PER_THREAD = 2
MAX_LANES = 16  # per launch (a lane's running best is held in registers)
MAX_WIDTH = 64

# Template constants: R (rank), LANES (at least the round's lanes, a power of two), VEC
# (weights per 16-byte load), T (the weights' type). Inputs: base [N, G, V], step [1]
# (k), prev_score / prev_id [N, B] (the step before's best per block; unread at k = 0),
# anchors [N], w1 [V, R], w2 [V, R] (markov_w2's weight, row v scores id v).
_STEP_SOURCE = """
    constexpr int WARPS = THREADS / 32;
    __shared__ float e[LANES * R];
    __shared__ int prev[LANES];
    __shared__ float warp_score[WARPS][LANES];
    __shared__ int warp_id[WARPS][LANES];
    const int lanes = anchors_shape[0], G = base_shape[1], V = base_shape[2], PB = prev_id_shape[1];
    const int k = step[0], t = threadIdx.x, warp = t / 32, lane32 = t % 32;
    for (int n = warp; n < lanes; n += WARPS) {
        int at = anchors[n];
        if (k > 0) {
            float top = -INFINITY;
            at = V;
            for (int b = lane32; b < PB; b += 32) {
                const float s = prev_score[n * PB + b];
                const int id = prev_id[n * PB + b];
                if (s > top || (s == top && id < at)) { top = s; at = id; }
            }
            for (int offset = 16; offset > 0; offset >>= 1) {
                const float s = __shfl_down_sync(0xffffffff, top, offset);
                const int id = __shfl_down_sync(0xffffffff, at, offset);
                if (s > top || (s == top && id < at)) { top = s; at = id; }
            }
            at = __shfl_sync(0xffffffff, at, 0);
            if (at >= V) at = 0;  // no finite score: the lane's faults say so
        }
        if (lane32 == 0) prev[n] = at;
    }
    __syncthreads();
    for (int i = t; i < lanes * R; i += THREADS) e[i] = static_cast<float>(w1[(size_t)prev[i / R] * R + i % R]);
    __syncthreads();
    float top[LANES];
    int at[LANES];
    #pragma unroll
    for (int n = 0; n < LANES; ++n) { top[n] = -INFINITY; at[n] = V; }
    for (int j = 0; j < VOCAB_PER_THREAD; ++j) {
        const int v = (blockIdx.x * VOCAB_PER_THREAD + j) * THREADS + t;  // rises with j: the first of equals stays
        if (v >= V) break;
        float acc[LANES];
        #pragma unroll
        for (int n = 0; n < LANES; ++n) acc[n] = 0.0f;
        const T* row = w2 + (size_t)v * R;
        for (int r = 0; r < R; r += VEC) {
            const uint4 raw = *reinterpret_cast<const uint4*>(row + r);
            const T* w = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int q = 0; q < VEC; ++q) {
                const float wq = static_cast<float>(w[q]);
                #pragma unroll
                for (int n = 0; n < LANES; ++n) acc[n] += wq * e[n * R + r + q];
            }
        }
        #pragma unroll
        for (int n = 0; n < LANES; ++n) {
            if (n < lanes) {
                const float s = acc[n] + static_cast<float>(base[((size_t)n * G + k) * V + v]);
                if (s > top[n]) { top[n] = s; at[n] = v; }
            }
        }
    }
    #pragma unroll
    for (int n = 0; n < LANES; ++n) {
        float s = top[n];
        int id = at[n];
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float os = __shfl_down_sync(0xffffffff, s, offset);
            const int oid = __shfl_down_sync(0xffffffff, id, offset);
            if (os > s || (os == s && oid < id)) { s = os; id = oid; }
        }
        if (lane32 == 0) { warp_score[warp][n] = s; warp_id[warp][n] = id; }
    }
    __syncthreads();
    if (t < lanes) {
        float s = warp_score[0][t];
        int id = warp_id[0][t];
        for (int w = 1; w < WARPS; ++w)
            if (warp_score[w][t] > s || (warp_score[w][t] == s && warp_id[w][t] < id)) { s = warp_score[w][t]; id = warp_id[w][t]; }
        best_score[t * gridDim.x + blockIdx.x] = s;
        best_id[t * gridDim.x + blockIdx.x] = id;
    }
"""

# Inputs: score0.., id0.. [N, B] (each step's best per block); output: tokens [N, G].
_TOKENS_SOURCE = """
    const int lanes = score0_shape[0], B = score0_shape[1];
    const int i = blockIdx.x * blockDim.x + threadIdx.x, n = i / G, k = i % G;
    if (n >= lanes) return;
    const float* score;
    const int* ids;
    switch (k) {
CASES
    }
    float top = -INFINITY;
    int at = V;
    for (int b = 0; b < B; ++b)
        if (score[n * B + b] > top || (score[n * B + b] == top && ids[n * B + b] < at)) { top = score[n * B + b]; at = ids[n * B + b]; }
    tokens[n * G + k] = at < V ? at : 0;
"""


class StepwiseGreedyChain:
    """`(U [N, g, V], anchors [N]) -> tokens [N, g] int32` for a Markov head of plain
    bfloat16, float16 or float32 weights on CUDA, g + 1 launches (see the module's
    docstring). Reads the head's weights as they are: `w2` row by row, 16 bytes a load."""

    def __init__(self, markov_w1: nn.Module, markov_w2: nn.Module):
        self.w1, self.w2 = markov_w1.weight, markov_w2.weight
        self.vocab, self.rank = self.w1.shape
        # Made and evaluated here, not while a proposal is traced: k as an array per step,
        # and what step 0 is given for the step before.
        self.steps = [mx.array([k], dtype=mx.int32) for k in range(MAX_WIDTH)]
        self.no_previous = (mx.zeros((1, 1), dtype=mx.float32), mx.zeros((1, 1), dtype=mx.int32))
        mx.eval(*self.steps, *self.no_previous)
        self.step_kernel = mx.fast.cuda_kernel(
            name="dspark_greedy_chain_step", input_names=["base", "step", "prev_score", "prev_id", "anchors", "w1", "w2"],
            output_names=["best_score", "best_id"], source=_STEP_SOURCE,
            header=f"#define THREADS {THREADS}\n#define VOCAB_PER_THREAD {VOCAB_PER_THREAD}\n")
        self.tokens_kernels: dict[int, object] = {}

    @staticmethod
    def serves(markov_w1: nn.Module, markov_w2: nn.Module) -> bool:
        """Whether the head's weights are plain arrays of one dtype the kernel reads in
        16-byte loads."""
        if not all("weight" in m and "scales" not in m for m in (markov_w1, markov_w2)) or "bias" in markov_w2:
            return False
        w1, w2 = markov_w1.weight, markov_w2.weight
        return (w1.dtype == w2.dtype and w2.dtype in (mx.bfloat16, mx.float16, mx.float32) and w1.shape == w2.shape
                and w2.shape[1] % (16 // w2.dtype.size) == 0)

    def __call__(self, base: mx.array, anchors: mx.array) -> mx.array:
        if base.shape[0] > MAX_LANES:
            return mx.concatenate([self(base[i : i + MAX_LANES], anchors[i : i + MAX_LANES])
                                   for i in range(0, base.shape[0], MAX_LANES)])
        lanes, width, vocab = base.shape
        if width > MAX_WIDTH:
            raise ValueError(f"the stepwise chain runs at most {MAX_WIDTH} steps, not {width}")
        blocks = -(-vocab // (VOCAB_PER_THREAD * THREADS))
        template = [("R", self.rank), ("LANES", 1 << (lanes - 1).bit_length()), ("VEC", 16 // self.w2.dtype.size),
                    ("T", self.w2.dtype)]
        anchors = anchors.astype(mx.int32)
        previous, best = self.no_previous, []
        for k in range(width):
            previous = self.step_kernel(
                inputs=[base, self.steps[k], *previous, anchors, self.w1, self.w2], template=template,
                grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                output_shapes=[(lanes, blocks)] * 2, output_dtypes=[mx.float32, mx.int32])
            best.append(previous)
        return self._tokens_kernel(width)(
            inputs=[*(s for s, _ in best), *(i for _, i in best)], template=[("G", width), ("V", vocab)],
            grid=(-(-lanes * width // 32) * 32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(lanes, width)], output_dtypes=[mx.int32])[0]

    def _tokens_kernel(self, width: int):
        if width not in self.tokens_kernels:
            cases = "\n".join(f"        case {k}: score = score{k}; ids = id{k}; break;" for k in range(width))
            self.tokens_kernels[width] = mx.fast.cuda_kernel(
                name=f"dspark_greedy_chain_tokens_{width}", input_names=[*(f"score{k}" for k in range(width)),
                                                                         *(f"id{k}" for k in range(width))],
                output_names=["tokens"], source=_TOKENS_SOURCE.replace("CASES", cases))
        return self.tokens_kernels[width]

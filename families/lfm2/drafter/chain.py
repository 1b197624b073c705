"""The greedy Markov chain of a proposal as CUDA kernels.

Greedy, the chain `l_k = U_k + w2(w1[x_k])`, `x_{k+1} = argmax l_k` is g dependent steps
of a gather, a rank-R product, an add and an argmax: about six launches per step as MLX
operations, which on a GPU cost host time per launch (the round is bound by it, not by
the arithmetic). Two kernels take their place, by the head's size:

- `FusedGreedyChain`, for small heads: one block per lane runs all g steps. It holds
  `w1[x_k]` in shared memory, each thread scores a strided share of the vocabulary, and
  a block reduction takes the argmax.
- `SteppedGreedyChain`, for large heads (a released drafter's 65536 x 256): one launch
  per step over the whole vocabulary, each thread one id for every lane, so each weight
  is read once per step for all lanes. The blocks meet in one 64-bit `atomicMax` per
  lane on (the score's order-preserving bits, the id's complement), and the next
  step's launch reads the winner: g + 1 launches instead of about 6g.

Both take the lowest id among equal scores, as `mx.argmax` does, and add the rank-R
product in float32 where the operations round it to the weights' dtype first, so a
near-tie may pick differently: a proposal only steers which rows are verified, never
what is emitted.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

THREADS = 256
# One block per lane scores the whole vocabulary at every step, so FusedGreedyChain serves
# small heads only: the embedded default's is 4096 x 64 (2^18 weights); a released
# drafter's (65536 x 256) kept one block busy for 140 ms a round on the H200, against 4 ms
# for the operations.
MAX_HEAD_WEIGHTS = 1 << 20
# SteppedGreedyChain keeps every lane's w1 row (float32) in a block's shared memory.
MAX_LANE_RANK_FLOATS = 48 * 1024 // 4

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

    @staticmethod
    def takes(lanes: int) -> bool:
        """Any number of lanes: one block each."""
        return True

    def __call__(self, base: mx.array, anchors: mx.array) -> mx.array:
        lanes, width, vocab = base.shape
        (tokens,) = self.kernel(
            inputs=[base.astype(mx.float32), anchors.astype(mx.int32), self.w1, self.w2t],
            template=[("V", vocab), ("R", self.rank), ("G", width)],
            grid=(lanes * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(lanes, width)], output_dtypes=[mx.int32])
        return tokens


# One step of SteppedGreedyChain (template K = the step). Step K < G scores x_{K+1} for
# every lane: thread v scores id v against each lane's w1[x_K] (the anchor at K = 0, else
# the winner `prev` of step K-1), and the best key per lane goes to `best` by a warp
# reduction and one atomicMax per warp and per block. Block 0 also copies the tokens so
# far, with x_K decoded from `prev`; step K = G only does that.
_STEP_HEADER = f"""
#define THREADS {THREADS}
// Order-preserving bits of a score above (id's complement) below: the largest key is the
// highest score, and among equal scores the lowest id. 0 is below every key: no score.
__device__ inline unsigned long long score_key(float score, unsigned int id) {{
    unsigned int bits = __float_as_uint(score == 0.0f ? 0.0f : score);  // -0 ties with 0, as in argmax
    bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)bits << 32) | (0xFFFFFFFFu - id);
}}
// The winning id of a key, 0 where every score was NaN (the lane's faults say so).
__device__ inline int key_id(unsigned long long key, int vocab) {{
    unsigned int id = 0xFFFFFFFFu - (unsigned int)(key & 0xFFFFFFFFull);
    return key != 0ull && id < (unsigned int)vocab ? (int)id : 0;
}}
"""

_STEP_SOURCE = """
    __shared__ float e[N * R];
    __shared__ unsigned long long block_best[N];
    const int t = threadIdx.x;
    if (blockIdx.x == 0) {
        for (int i = t; i < N * G; i += THREADS) {
            const int n = i / G, col = i % G;
            tokens[i] = col == K - 1 ? key_id(prev[n], V) : (col < K - 1 ? tokens_in[i] : 0);
        }
    }
    if (K == G) return;
    for (int n = t; n < N; n += THREADS) block_best[n] = 0ull;
    for (int i = t; i < N * R; i += THREADS) {
        const int n = i / R, r = i % R;
        const int x = K == 0 ? anchors[n] : key_id(prev[n], V);
        e[i] = static_cast<float>(w1[(size_t)x * R + r]);
    }
    __syncthreads();
    const int v = blockIdx.x * THREADS + t;
    float acc[N];
    for (int n = 0; n < N; ++n) acc[n] = 0.0f;
    if (v < V) {
        for (int r = 0; r < R; ++r) {
            const float w = static_cast<float>(w2t[(size_t)r * V + v]);
            for (int n = 0; n < N; ++n) acc[n] += w * e[n * R + r];
        }
    }
    for (int n = 0; n < N; ++n) {
        unsigned long long key = 0ull;
        if (v < V) {
            const float score = acc[n] + base[((size_t)n * G + K) * V + v];
            if (score == score) key = score_key(score, v);  // NaN never wins
        }
        for (int step = 16; step > 0; step >>= 1) {
            const unsigned long long other = __shfl_down_sync(0xFFFFFFFFu, key, step);
            key = other > key ? other : key;
        }
        if ((t & 31) == 0 && key) atomicMax(&block_best[n], key);
    }
    __syncthreads();
    for (int n = t; n < N; n += THREADS) {
        if (block_best[n]) atomicMax((unsigned long long*)&best[n], block_best[n]);
    }
"""


class SteppedGreedyChain:
    """`(U [N, g, V], anchors [N]) -> tokens [N, g] int32` for a large Markov head of plain
    (unquantized) weights, on CUDA: one launch per step, every block a share of the
    vocabulary for all lanes. Keeps `w2` transposed (rank x vocabulary, so that
    neighbouring threads read neighbouring weights) in its own dtype."""

    def __init__(self, markov_w1: nn.Module, markov_w2: nn.Module):
        self.w1 = markov_w1.weight
        self.w2t = mx.contiguous(markov_w2.weight.T)
        self.vocab, self.rank = self.w1.shape
        self.none = mx.zeros((1,), dtype=mx.uint64)  # `prev` and `tokens_in` of the first step, never read there
        self.no_tokens = mx.zeros((1,), dtype=mx.int32)
        mx.eval(self.w2t, self.none, self.no_tokens)
        self.kernel = mx.fast.cuda_kernel(name="dspark_greedy_chain_step",
                                          input_names=["base", "anchors", "prev", "tokens_in", "w1", "w2t"],
                                          output_names=["best", "tokens"], source=_STEP_SOURCE, header=_STEP_HEADER)

    @staticmethod
    def serves(markov_w1: nn.Module, markov_w2: nn.Module) -> bool:
        """Whether the head's weights are plain arrays the kernel can read."""
        plain = all("weight" in m and "scales" not in m for m in (markov_w1, markov_w2))
        return plain and "bias" not in markov_w2

    def takes(self, lanes: int) -> bool:
        """Whether every lane's w1 row fits a block's shared memory."""
        return lanes * self.rank <= MAX_LANE_RANK_FLOATS

    def __call__(self, base: mx.array, anchors: mx.array) -> mx.array:
        lanes, width, vocab = base.shape
        base, anchors = base.astype(mx.float32), anchors.astype(mx.int32)
        best, tokens = self.none, self.no_tokens
        for k in range(width + 1):
            blocks = -(-vocab // THREADS) if k < width else 1
            best, tokens = self.kernel(
                inputs=[base, anchors, best, tokens, self.w1, self.w2t],
                template=[("V", vocab), ("R", self.rank), ("G", width), ("N", lanes), ("K", k)],
                grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                output_shapes=[(lanes,), (lanes, width)], output_dtypes=[mx.uint64, mx.int32], init_value=0.0)
        return tokens


def greedy_chain(markov_w1: nn.Module, markov_w2: nn.Module):
    """The kernel for this Markov head's greedy chain, by its size; None where its weights
    are not plain arrays (quantized, or a biased w2)."""
    if FusedGreedyChain.serves(markov_w1, markov_w2):
        return FusedGreedyChain(markov_w1, markov_w2)
    if SteppedGreedyChain.serves(markov_w1, markov_w2):
        return SteppedGreedyChain(markov_w1, markov_w2)
    return None

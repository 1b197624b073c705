"""The greedy Markov chain of a proposal as one CUDA kernel.

Greedy, the chain `l_k = U_k + w2(w1[x_k])`, `x_{k+1} = argmax l_k` is g dependent steps
of a gather, a rank-R product, an add and an argmax: about six launches per step as MLX
operations, which on a GPU cost host time per launch (the round is bound by it, not by
the arithmetic). Here one block per lane runs all g steps: it holds `w1[x_k]` in shared
memory, each thread scores a strided share of the vocabulary, and a block reduction
takes the argmax (the lowest id among equal scores, as `mx.argmax` does). The scores
add the rank-R product in float32 where the operations round it to the weights' dtype
first, so a near-tie may pick differently: a proposal only steers which rows are
verified, never what is emitted.
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

"""The greedy Markov chain as one CUDA kernel equals the chain as MLX operations (float32);
the kernel tests run only where MLX has its CUDA backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from families.lfm2.drafter import load_drafter
from families.lfm2.drafter.chain import FusedGreedyChain
from families.lfm2.loader import load_model
from families.lfm2.target import Lfm2Target
from tests.cuda import needs_cuda


def chain_as_operations(base, anchors, w1, w2):
    prev, tokens = anchors, []
    for k in range(base.shape[1]):
        prev = mx.argmax(base[:, k] + w2(w1(prev)), axis=-1).astype(mx.int32)
        tokens.append(prev)
    return mx.stack(tokens, axis=1)


@needs_cuda
@pytest.mark.parametrize("lanes,width,vocab,rank", [(1, 9, 4096, 64), (5, 4, 1000, 16), (16, 8, 300, 8)])
def test_kernel_picks_what_the_operations_pick(on_gpu, lanes, width, vocab, rank):
    mx.random.seed(lanes)
    w1, w2 = nn.Embedding(vocab, rank), nn.Linear(rank, vocab, bias=False)
    base = mx.random.normal((lanes, width, vocab))
    anchors = mx.random.randint(0, vocab, (lanes,)).astype(mx.int32)
    fused = FusedGreedyChain(w1, w2)(base, anchors)
    np.testing.assert_array_equal(np.array(fused), np.array(chain_as_operations(base, anchors, w1, w2)))


def test_only_small_plain_heads_are_fused():
    assert FusedGreedyChain.serves(nn.Embedding(4096, 64), nn.Linear(64, 4096, bias=False))
    assert not FusedGreedyChain.serves(nn.Embedding(65536, 256), nn.Linear(256, 65536, bias=False))
    quantized = nn.QuantizedLinear(64, 4096, bias=False, group_size=64, bits=8)
    assert not FusedGreedyChain.serves(nn.Embedding(4096, 64), quantized)


@needs_cuda
def test_a_greedy_proposal_is_the_same_with_the_kernel(on_gpu, dense_dir, drafter_dir):
    model, cfg = load_model(dense_dir, dtype="float32")
    runner = Lfm2Target(model, cfg, max_lanes=3)
    prompts = [[5, 9, 23, 7, 1, 44], [3, 3, 3], [60, 2, 31, 31, 8, 19, 4, 11]]
    drafters = [load_drafter(drafter_dir, model, cfg, dtype="float32", max_lanes=3) for _ in range(2)]
    assert drafters[0].fused_chain is not None
    drafters[1].fused_chain = None
    taps = []
    for prompt in prompts:
        _, rows = runner.prefill(runner.open_lane(), prompt, chunk=8, taps=drafters[0].tap_layers)
        taps.append(rows)
    proposals = []
    for drafter in drafters:
        lanes = [drafter.open_lane() for _ in prompts]
        drafter.append(lanes, taps, prompts)
        proposal = drafter.propose(lanes, [p[-1] for p in prompts], chain_logits=False)
        mx.eval(*proposal.arrays())
        proposals.append(proposal)
    fused, ops = proposals
    np.testing.assert_array_equal(np.array(fused.tokens), np.array(ops.tokens))
    np.testing.assert_allclose(np.array(fused.confidences), np.array(ops.confidences), rtol=0, atol=1e-5)
    assert np.array(fused.faults).tolist() == [0, 0, 0]

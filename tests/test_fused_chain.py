"""The greedy Markov chain as CUDA kernels equals the chain as MLX operations (float32);
the kernel tests run only where MLX has its CUDA backend."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from families.lfm2.drafter import load_drafter
from families.lfm2.drafter.chain import FusedGreedyChain, SteppedGreedyChain, greedy_chain
from families.lfm2.loader import load_model
from families.lfm2.target import Lfm2Target
from tests.cuda import needs_cuda


def chain_as_operations(base, anchors, w1, w2):
    prev, tokens = anchors, []
    for k in range(base.shape[1]):
        prev = mx.argmax(base[:, k] + w2(w1(prev)), axis=-1).astype(mx.int32)
        tokens.append(prev)
    return mx.stack(tokens, axis=1)


SHAPES = [(1, 9, 4096, 64), (5, 4, 1000, 16), (16, 8, 300, 8)]
# A released drafter's head, and vocabularies that leave the last block of a step part empty.
LARGE_SHAPES = [(1, 9, 65536, 256), (16, 9, 65536, 256), (3, 5, 50000, 128), (7, 2, 257, 32)]


@needs_cuda
@pytest.mark.parametrize("kernel,lanes,width,vocab,rank",
                         [(FusedGreedyChain, *shape) for shape in SHAPES] + [(SteppedGreedyChain, *shape) for shape in SHAPES + LARGE_SHAPES])
def test_kernel_picks_what_the_operations_pick(on_gpu, kernel, lanes, width, vocab, rank):
    mx.random.seed(lanes * vocab)
    w1, w2 = nn.Embedding(vocab, rank), nn.Linear(rank, vocab, bias=False)
    base = mx.random.normal((lanes, width, vocab))
    anchors = mx.random.randint(0, vocab, (lanes,)).astype(mx.int32)
    fused = kernel(w1, w2)(base, anchors)
    np.testing.assert_array_equal(np.array(fused), np.array(chain_as_operations(base, anchors, w1, w2)))


@needs_cuda
@pytest.mark.parametrize("kernel", [FusedGreedyChain, SteppedGreedyChain])
def test_equal_scores_pick_the_lowest_id(on_gpu, kernel):
    vocab, rank, width = 700, 8, 3
    w1, w2 = nn.Embedding(vocab, rank), nn.Linear(rank, vocab, bias=False)
    w2.weight = mx.zeros_like(w2.weight)  # the scores are the base's alone
    base = mx.zeros((2, width, vocab))
    base[0, :, 650] = 2.0
    base[0, :, 3] = 2.0  # lane 0: a tie at ids 3 and 650, in different blocks of a step
    base[1, :, 299] = -1.0
    base = base - mx.array([0.0, 5.0])[:, None, None]  # lane 1: every score negative, the first of them all
    tokens = kernel(w1, w2)(base, mx.array([1, 2], dtype=mx.int32))
    assert np.array(tokens).tolist() == [[3, 3, 3], [0, 0, 0]]


def test_small_plain_heads_run_in_one_launch_and_large_ones_step_by_step():
    small = (nn.Embedding(4096, 64), nn.Linear(64, 4096, bias=False))
    large = (nn.Embedding(65536, 256), nn.Linear(256, 65536, bias=False))
    assert FusedGreedyChain.serves(*small) and SteppedGreedyChain.serves(*small)
    assert not FusedGreedyChain.serves(*large) and SteppedGreedyChain.serves(*large)
    quantized = nn.QuantizedLinear(64, 4096, bias=False, group_size=64, bits=8)
    assert not FusedGreedyChain.serves(nn.Embedding(4096, 64), quantized)
    assert not SteppedGreedyChain.serves(nn.Embedding(4096, 64), quantized)
    assert greedy_chain(nn.Embedding(4096, 64), quantized) is None
    assert not SteppedGreedyChain.serves(nn.Embedding(4096, 64), nn.Linear(64, 4096, bias=True))


@needs_cuda
def test_greedy_chain_picks_the_kernel_by_the_heads_size(on_gpu):
    assert isinstance(greedy_chain(nn.Embedding(4096, 64), nn.Linear(64, 4096, bias=False)), FusedGreedyChain)
    stepped = greedy_chain(nn.Embedding(65536, 256), nn.Linear(256, 65536, bias=False))
    assert isinstance(stepped, SteppedGreedyChain)
    assert stepped.takes(16) and not stepped.takes(64)


@needs_cuda
@pytest.mark.parametrize("kernel", [FusedGreedyChain, SteppedGreedyChain])
def test_a_greedy_proposal_is_the_same_with_the_kernel(on_gpu, dense_dir, drafter_dir, kernel):
    model, cfg = load_model(dense_dir, dtype="float32")
    runner = Lfm2Target(model, cfg, max_lanes=3)
    prompts = [[5, 9, 23, 7, 1, 44], [3, 3, 3], [60, 2, 31, 31, 8, 19, 4, 11]]
    drafters = [load_drafter(drafter_dir, model, cfg, dtype="float32", max_lanes=3) for _ in range(2)]
    assert isinstance(drafters[0].fused_chain, FusedGreedyChain)
    markov = drafters[0].model.markov_head
    drafters[0].fused_chain = kernel(markov.markov_w1, markov.markov_w2)  # before the first proposal is traced
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

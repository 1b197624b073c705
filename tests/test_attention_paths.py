"""Which attention path a query takes (families/lfm2/model.py `fused_attention`), and
that both paths compute the same attention: where the backend plans per shape (CUDA),
only steady prompt chunks take the fused kernel, so the matmul path must stand in for
it on any mask, "causal" included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import model, open_target
from families.lfm2.model import (
    MATMUL_SCORES,
    SMALL_QUERY,
    STEADY_QUERY,
    attend,
    fused_attention,
)
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request


@pytest.fixture
def plans(monkeypatch):
    """Pretend the backend plans per shape (as CUDA's does)."""
    monkeypatch.setattr(model, "plans_per_shape", lambda: True)


def test_where_plans_are_per_shape_only_steady_chunks_take_the_fused_kernel(plans):
    assert fused_attention(1)
    assert not any(fused_attention(t) for t in (2, SMALL_QUERY, SMALL_QUERY + 1, STEADY_QUERY - 1, STEADY_QUERY + 1, 511))
    assert all(fused_attention(t) for t in (STEADY_QUERY, 2 * STEADY_QUERY, 4 * STEADY_QUERY))


def test_a_partial_chunk_over_a_long_context_keeps_the_fused_kernel(plans):
    assert not fused_attention(STEADY_QUERY + 1, MATMUL_SCORES)
    assert fused_attention(STEADY_QUERY + 1, MATMUL_SCORES + 1)
    assert not fused_attention(SMALL_QUERY, 10 * MATMUL_SCORES)  # a round's few rows: matmuls whatever the span


def test_elsewhere_every_prompt_chunk_takes_it():
    assert fused_attention(1) and not fused_attention(SMALL_QUERY)
    assert all(fused_attention(t) for t in (SMALL_QUERY + 1, 100, STEADY_QUERY + 1, 511))


def _qkv(n, t, s, heads=4, kv_heads=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    def arr(*shape):
        return mx.array(rng.standard_normal(shape), dtype=mx.float32)
    return arr(n, heads, t, d), arr(n, kv_heads, s, d), arr(n, kv_heads, s, d)


@pytest.mark.parametrize("t, s", [(5, 5), (5, 40), (40, 40), (40, 300), (STEADY_QUERY + 3, STEADY_QUERY + 20)])
def test_the_matmul_path_equals_the_fused_kernel_on_every_mask(plans, t, s):
    q, k, v = _qkv(2, t, s)
    positions = mx.array([[s - t], [max(s - t - 2, 0)]], dtype=mx.int32) + mx.arange(t)[None, :]  # lane 1 sees fewer keys
    boolean = (mx.arange(s)[None, None, :] <= positions[:, :, None])[:, None]
    for mask in (None, "causal", boolean):
        lanes = slice(0, 1) if mask == "causal" else slice(None)  # "causal" aligns one lane's rows to its keys
        got = attend(q[lanes], k[lanes], v[lanes], 0.25, mask)
        want = mx.fast.scaled_dot_product_attention(q[lanes], k[lanes], v[lanes], scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_prompts_read_either_way_give_the_same_tokens(dense_dir, monkeypatch):
    """A prompt read in a full chunk of STEADY_QUERY rows and a partial one, with and
    without plans per shape: the partial chunk's attention changes path, not the output."""
    prompt = [1] + [int(t) for t in np.random.default_rng(7).integers(15, 500, STEADY_QUERY + 40)]

    def tokens():
        loaded = open_target(dense_dir, max_lanes=1)
        engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=1, prefill_chunk=STEADY_QUERY))
        (done,) = engine.generate([Request(prompt, 12)])
        return done.token_ids

    plain = tokens()
    monkeypatch.setattr(model, "plans_per_shape", lambda: True)
    assert tokens() == plain


def test_a_partial_chunk_padded_to_a_steady_width_keeps_to_the_matmuls(dense_dir, plans, monkeypatch):
    # A steady prompt read pads 200 rows to 256, a multiple of STEADY_QUERY: its attention
    # still goes by the rows the lane brought (matmuls), its key span no steadier than a
    # partial chunk's ever was, and the tokens are those of the read unpadded.
    prompt = [1] + [int(t) for t in np.random.default_rng(8).integers(15, 500, 199)]
    fused_rows, attended_rows = [], []
    fused, attend_as_is = mx.fast.scaled_dot_product_attention, model.attend

    def watched(q, *args, **kwargs):
        fused_rows.append(q.shape[2])
        return fused(q, *args, **kwargs)

    def attending(q, *args, **kwargs):
        attended_rows.append(q.shape[2])
        return attend_as_is(q, *args, **kwargs)

    def tokens(steady: bool):
        loaded = open_target(dense_dir, max_lanes=1)
        engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=1, steady_shapes=steady))
        (done,) = engine.generate([Request(prompt, 6)])
        return done.token_ids

    plain = tokens(False)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", watched)
    monkeypatch.setattr(model, "attend", attending)
    assert tokens(True) == plain
    assert STEADY_QUERY in attended_rows  # the read was padded
    assert [t for t in fused_rows if t > 1] == []

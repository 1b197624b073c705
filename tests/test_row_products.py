"""Small weights times a few rows as matrix-vector products (families/lfm2/model.py
`row_products`): what a CUDA backend serves to skip cuBLASLt's per-call planning. The
CPU runs it on request: the products equal the matmuls, only small unquantized maps are
swapped, and drafted output equals plain output with every map served this way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from bench.scripted import ScriptedDrafter, published_profile
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from families.lfm2.model import (
    ROW_PRODUCT_BYTES,
    ROW_PRODUCT_ROWS,
    RowProductLinear,
    row_products,
    serve_linears_by_rows,
    swiglu,
)
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from tests.priced import assert_drafted, price_without_timing

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(40 + i).integers(15, 500, 6 + 3 * i)] for i in range(4)]


@pytest.mark.parametrize("lead", [(1,), (2,), (9,), (ROW_PRODUCT_ROWS,), (ROW_PRODUCT_ROWS + 1,), (3, 4), (2, 9, 1)])
def test_row_products_equal_the_matmul(lead):
    rng = np.random.default_rng(sum(lead))
    weight = mx.array(rng.standard_normal((24, 40)), dtype=mx.float32)
    x = mx.array(rng.standard_normal((*lead, 40)), dtype=mx.float32)
    got = row_products(weight, x)
    assert got.shape == (*lead, 24)
    np.testing.assert_allclose(np.array(got), np.array(x @ weight.T), rtol=1e-5, atol=1e-5)


def test_one_row_of_a_split_product_equals_the_matmul():
    """One lane's FFN: SwiGLU over the halves of the merged w1|w3 product, then w2."""
    rng = np.random.default_rng(7)
    w13, w2 = (mx.array(rng.standard_normal(shape), dtype=mx.float32) for shape in ((128, 32), (32, 64)))
    for lead in ((1,), (1, 1)):
        hidden = swiglu(*mx.split(mx.array(rng.standard_normal((*lead, 32)), dtype=mx.float32) @ w13.T, 2, axis=-1))
        got = row_products(w2, hidden)
        assert got.shape == (*lead, 32)
        np.testing.assert_allclose(np.array(got), np.array(hidden @ w2.T), rtol=1e-5, atol=1e-5)


def test_only_small_unquantized_linear_maps_are_swapped():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 32, bias=False), nn.Linear(64, 64), nn.Linear(ROW_PRODUCT_BYTES // 4 // 64 + 1, 64))
    model.layers[2] = nn.QuantizedLinear(64, 64, group_size=32, bits=8)
    serve_linears_by_rows(model)
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [RowProductLinear, RowProductLinear, nn.QuantizedLinear, nn.Linear]
    x = mx.ones((3, 64))
    np.testing.assert_allclose(np.array(model.layers[0](x)), np.array(x @ model.layers[0].weight.T + model.layers[0].bias),
                               rtol=1e-5, atol=1e-6)  # the layer's random outputs may land near 0


@pytest.fixture(scope="module")
def by_rows(dense_dir, drafter_dir):
    loaded = open_target(dense_dir, max_lanes=4, by_rows=True)
    drafter = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, max_lanes=4, by_rows=True)
    return loaded, drafter


def test_target_and_drafter_serve_their_maps_by_rows(by_rows):
    loaded, drafter = by_rows
    model = loaded.target.model
    assert type(model.layers[0].conv.in_proj) is RowProductLinear and model.head_by_rows
    assert type(drafter.model.layers[0].mlp.down_proj) is RowProductLinear
    assert type(drafter.model.markov_head.markov_w2) is RowProductLinear


@pytest.mark.parametrize("config", [{"draft_width": 6}, {"price_live": False}], ids=["fixed", "priced-ahead"])
def test_drafted_equals_plain_by_rows(config, by_rows):
    loaded, drafter = by_rows
    plain_engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=4))
    plain = [d.token_ids for d in plain_engine.generate([Request(p, 32) for p in PROMPTS])]
    scripted = ScriptedDrafter(drafter, [p + t for p, t in zip(PROMPTS, plain)], published_profile(), loaded.target.vocab_size)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, scripted, EngineConfig(max_streams=4, **config))
    if "draft_width" not in config:
        price_without_timing(engine)
    done = engine.generate([Request(p, 32) for p in PROMPTS])
    assert [d.token_ids for d in done] == plain
    # The scripted drafter keeps the published profile's share: at least a round per lane, and a draft kept.
    assert_drafted(done, len(PROMPTS), 1)

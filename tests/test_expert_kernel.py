"""A few rows times their chosen experts as laneserve's CUDA kernel
(families/lfm2/expert_kernel.py): its products equal float32 products within the weights'
rounding, for rows shared by a row's pairs and for a row per pair, for experts no row
chose and weights whose rows do not fill its blocks; a pair's product does not depend on
the rows that come with it; a MoE layer's experts take it on CUDA only, for 2-16 rows.
The kernel tests run only where MLX has its CUDA backend."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import expert_kernel
from families.lfm2.model import Experts
from tests.cuda import needs_cuda


def routed(rng, rows: int, experts: int, k: int) -> np.ndarray:
    return np.stack([rng.choice(experts, k, replace=False) for _ in range(rows)]).astype(np.int32)


def float32_products(x: np.ndarray, weight: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    rows, k = chosen.shape
    per_pair = x.shape[0] == rows * k
    return np.stack([x[p if per_pair else p // k] @ weight[chosen.flat[p]].T for p in range(rows * k)])


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.bfloat16, 2e-2), (mx.float16, 2e-3)])
@pytest.mark.parametrize("rows,experts,k", [(1, 32, 4), (2, 3, 2), (5, 8, 1), (16, 32, 4), (16, 64, 8), (9, 5, 5)])
@pytest.mark.parametrize("n,depth", [(40, 24), (1001, 264), (3584, 2048)])
@pytest.mark.parametrize("per_pair", [False, True])
def test_products_equal_float32_products(on_gpu, dtype, tolerance, rows, experts, k, n, depth, per_pair):
    rng = np.random.default_rng(rows * n + depth + k)
    weight = (rng.standard_normal((experts, n, depth)) / np.sqrt(depth)).astype(np.float32)
    x = rng.standard_normal((rows * k if per_pair else rows, depth)).astype(np.float32)
    chosen = routed(rng, rows, experts, k)
    w, xs = mx.array(weight).astype(dtype), mx.array(x).astype(dtype)
    exact = float32_products(np.array(xs.astype(mx.float32)), np.array(w.astype(mx.float32)), chosen)
    got = expert_kernel.rows_times_experts(xs, w, mx.array(chosen))
    assert got.dtype == dtype and got.shape == (rows * k, n)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), exact, rtol=tolerance, atol=tolerance * np.abs(exact).max())


@needs_cuda
def test_a_pair_is_the_same_whatever_rows_come_with_it(on_gpu):
    rng = np.random.default_rng(3)
    weight = mx.random.normal((16, 200, 512)).astype(mx.bfloat16)
    x = mx.random.normal((16, 512)).astype(mx.bfloat16)
    chosen = mx.array(routed(rng, 16, 16, 4))
    together = np.array(expert_kernel.rows_times_experts(x, weight, chosen).astype(mx.float32))
    for rows in (1, 3, 8):
        alone = expert_kernel.rows_times_experts(x[:rows], weight, chosen[:rows])
        np.testing.assert_array_equal(np.array(alone.astype(mx.float32)), together[: rows * 4])


@needs_cuda
def test_too_many_rows_are_refused(on_gpu):
    with pytest.raises(ValueError, match="1 to 16 rows"):
        expert_kernel.rows_times_experts(mx.ones((17, 8), dtype=mx.bfloat16), mx.ones((4, 8, 8), dtype=mx.bfloat16),
                                         mx.zeros((17, 1), dtype=mx.int32))


@needs_cuda
def test_experts_take_the_kernel_on_cuda_for_a_few_rows(on_gpu):
    experts = Experts(8, 64, 48)
    for m in (experts.w1, experts.w3, experts.w2):
        m.weight = mx.random.normal(m.weight.shape).astype(mx.bfloat16) * 0.2
    experts.merge_projections()
    x = mx.random.normal((6, 64)).astype(mx.bfloat16)
    chosen = mx.array(routed(np.random.default_rng(0), 6, 8, 2))
    gathered, one_gathered = experts(x, chosen), experts(x[:1], chosen[:1])
    experts.serve_by_kernel()
    assert experts.by_kernel
    by_kernel = experts(x, chosen)
    # One row keeps gather_mm's GEMV.
    np.testing.assert_array_equal(np.array(experts(x[:1], chosen[:1]).astype(mx.float32)),
                                  np.array(one_gathered.astype(mx.float32)))
    assert by_kernel.shape == gathered.shape == (6, 2, 64)
    np.testing.assert_array_equal(np.array(by_kernel.astype(mx.float32)),
                                  np.array(experts.kernel_products(x, chosen).reshape(6, 2, 64).astype(mx.float32)))
    scale = mx.abs(gathered.astype(mx.float32)).max().item()
    assert mx.abs(by_kernel.astype(mx.float32) - gathered.astype(mx.float32)).max().item() < 2e-2 * scale


@needs_cuda
@pytest.mark.parametrize("rows", [3, 16, 40])  # 12 pairs gather unsorted, 64 and 160 sorted
def test_gathered_experts_equal_float32_products(on_gpu, rows):
    """The path the kernel does not take (quantized or float32 experts, more than 16 rows),
    through MLX's gather_mm."""
    rng = np.random.default_rng(rows)
    experts = Experts(16, 64, 48)
    for m in (experts.w1, experts.w3, experts.w2):
        m.weight = mx.array(rng.standard_normal(m.weight.shape).astype(np.float32) * 0.2).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((rows, 64)).astype(np.float32)).astype(mx.bfloat16)
    chosen = routed(rng, rows, 16, 4)
    w1, w3, w2 = (np.array(m.weight.astype(mx.float32)) for m in (experts.w1, experts.w3, experts.w2))
    xs = np.array(x.astype(mx.float32))
    gate, up = float32_products(xs, w1, chosen), float32_products(xs, w3, chosen)
    exact = float32_products(gate / (1 + np.exp(-gate)) * up, w2, chosen).reshape(rows, 4, -1)
    experts.merge_projections()
    got = np.array(experts(x, mx.array(chosen)).astype(mx.float32))
    np.testing.assert_allclose(got, exact, rtol=3e-2, atol=3e-2 * np.abs(exact).max())


def test_only_kernel_shapes_are_served():
    weight = mx.zeros((8, 16, 64), dtype=mx.bfloat16)
    assert expert_kernel.serves(weight, 16, 4)
    assert not expert_kernel.serves(weight, 17, 4)  # one 16-row tile per expert
    assert not expert_kernel.serves(mx.zeros((8, 16, 60), dtype=mx.bfloat16), 1, 1)  # whole 16-byte loads
    assert not expert_kernel.serves(mx.zeros((8, 16, 64), dtype=mx.float32), 1, 1)  # float32 keeps gather_mm
    assert not expert_kernel.serves(mx.zeros((16, 64), dtype=mx.bfloat16), 1, 1)
    experts = Experts(4, 64, 32)
    experts.set_dtype(mx.bfloat16)
    experts.serve_by_kernel()
    assert experts.by_kernel == expert_kernel.available()  # the CPU keeps gather_mm

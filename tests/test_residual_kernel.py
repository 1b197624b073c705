"""A residual add and the RMSNorm after it by laneserve's CUDA kernel
(families/lfm2/residual_kernel.py): the sum is the dtype's rounded sum, the normed rows equal
the norm's within the dtype's rounding; a target and a drafter serving their residual adds by
it run rounds and proposals as the operations do. The kernel tests run only where MLX has
its CUDA backend; on the CPU the same rounds run through the kernel's path with the kernel
emulated as operations, and serving never takes the kernel there (tests/test_attention_kernel.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import residual_kernel
from tests.cuda import needs_cuda
from tests.test_attention_kernel import proposals, rounded, served
from tests.test_conv_kernel import run_rounds


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 2048), (16, 2048), (3, 9, 128), (5, 300), (2, 4096)])
def test_sum_and_norm_equal_the_operations(on_gpu, dtype, tolerance, shape):
    rng = np.random.default_rng(sum(shape))
    h, r = (rounded(rng.standard_normal(shape) * 4, dtype) for _ in range(2))
    weight = rounded(1 + rng.standard_normal(shape[-1]) / 4, dtype)
    eps = 1e-5
    total, normed = residual_kernel.add_rms_norm(mx.array(h).astype(dtype), mx.array(r).astype(dtype),
                                                 mx.array(weight).astype(dtype), eps)
    expected_total = rounded(h + r, dtype)
    expected = expected_total / np.sqrt((expected_total**2).mean(-1, keepdims=True) + eps) * weight
    assert total.shape == normed.shape == shape and total.dtype == normed.dtype == dtype
    np.testing.assert_array_equal(np.array(total.astype(mx.float32)), expected_total)
    np.testing.assert_allclose(np.array(normed.astype(mx.float32)), expected, rtol=tolerance, atol=tolerance)


def test_rows_that_do_not_add_are_refused():
    with pytest.raises(ValueError, match="do not add and norm"):
        residual_kernel.add_rms_norm(mx.zeros((2, 8)), mx.zeros((2, 9)), mx.ones((8,)), 1e-5)
    with pytest.raises(ValueError, match="do not add and norm"):
        residual_kernel.add_rms_norm(mx.zeros((2, 8)), mx.zeros((2, 8)), mx.ones((9,)), 1e-5)


def serving(dirs, by_kernel: bool):
    target, drafter = served(dirs)
    target.model.residual_by_kernel = drafter.residual_by_kernel = by_kernel
    return target, drafter


@needs_cuda
def test_a_target_and_drafter_by_kernel_run_as_the_operations_do(on_gpu, wide_heads):
    # The operations' float32 matmuls run in TF32 on the GPU; a sum or norm of the wrong
    # rows moves logits by far more than that.
    results = [run_rounds(serving(wide_heads, by_kernel)[0]) for by_kernel in (True, False)]
    for got, expected in zip(*(logits + pools for logits, pools in results)):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    for got, expected in zip(proposals(*serving(wide_heads, True)), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def emulated_add_rms_norm(h, r, weight, eps):
    """`residual_kernel.add_rms_norm` as MLX operations: what the kernel computes, on any device."""
    total = h + r
    return total, mx.fast.rms_norm(total, weight, eps)


def test_rounds_through_the_kernel_path_equal_the_operations_on_the_cpu(wide_heads, monkeypatch):
    # The kernel's wiring (which add goes with which norm, the taps, the segments'
    # seams, the drafter's final norm) checked in CI with the kernel emulated.
    calls = []
    monkeypatch.setattr(residual_kernel, "add_rms_norm", lambda *args: calls.append(args[0].shape) or emulated_add_rms_norm(*args))
    target, _ = serving(wide_heads, True)
    kernel_logits, kernel_pools = run_rounds(target)
    ops_logits, ops_pools = run_rounds(serving(wide_heads, False)[0])
    layers = len(target.model.layers)
    # Traced once per round shape (ragged prefill, steady read, step, verify), each a layer's
    # two adds but the last layer's second, which no norm follows in the round.
    assert len(calls) == 4 * (2 * layers - 1)
    for got, expected in zip(kernel_logits + kernel_pools, ops_logits + ops_pools):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    calls.clear()
    target, drafter = serving(wide_heads, False)
    drafter.residual_by_kernel = True
    for got, expected in zip(proposals(target, drafter), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * len(drafter.model.layers)  # one trace of the block: every add, the last with the final norm


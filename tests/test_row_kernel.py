"""A few rows times a large weight as laneserve's CUDA kernel (families/lfm2/row_kernel.py):
its products equal float32 products within the weights' rounding, for every row count it
serves and for weights whose rows do not fill its blocks, and a row's product does not
depend on the rows that come with it; `row_products` takes it for large
weights and up to 16 rows on CUDA only. The kernel tests run only where MLX has its CUDA backend."""

from __future__ import annotations

import inspect

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import row_kernel
from families.lfm2.model import (
    ROW_KERNEL_ROWS,
    ROW_PRODUCT_BYTES,
    row_products,
    served_by_rows,
)
from tests.cuda import needs_cuda


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.bfloat16, 2e-2), (mx.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 15, 16])
@pytest.mark.parametrize("n,k", [(40, 24), (1001, 264), (3072, 2048), (7, 10752)])
def test_products_equal_float32_products(on_gpu, dtype, tolerance, rows, n, k):
    rng = np.random.default_rng(rows * n + k)
    weight = mx.array(rng.standard_normal((n, k)) / np.sqrt(k), dtype=mx.float32).astype(dtype)
    x = mx.array(rng.standard_normal((rows, k)), dtype=mx.float32).astype(dtype)
    exact = np.array(x.astype(mx.float32)) @ np.array(weight.astype(mx.float32)).T
    got = row_kernel.rows_times_weight(x, weight)
    assert got.dtype == dtype and got.shape == (rows, n)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), exact, rtol=tolerance, atol=tolerance * np.abs(exact).max())


@needs_cuda
def test_too_many_rows_are_refused(on_gpu):
    with pytest.raises(ValueError, match="1 to 16 rows"):
        row_kernel.rows_times_weight(mx.ones((17, 8), dtype=mx.bfloat16), mx.ones((4, 8), dtype=mx.bfloat16))


@needs_cuda
@pytest.mark.parametrize("launch", row_kernel.LAUNCHES, ids=str)
def test_every_launch_gives_the_products_and_a_row_whatever_rows_come_with_it(on_gpu, launch):
    # K = 1288 is not a whole number of any launch's chunks: the last ones are partial.
    rng = np.random.default_rng(launch.warps + launch.depth)
    weight = mx.array(rng.standard_normal((300, 1288)) / np.sqrt(1288), dtype=mx.float32).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((16, 1288)), dtype=mx.float32).astype(mx.bfloat16)
    together = np.array(row_kernel.rows_times_weight(x, weight, launch).astype(mx.float32))
    exact = np.array(x.astype(mx.float32)) @ np.array(weight.astype(mx.float32)).T
    np.testing.assert_allclose(together, exact, rtol=2e-2, atol=2e-2 * np.abs(exact).max())
    for rows in (1, 5, 9, 15):
        np.testing.assert_array_equal(np.array(row_kernel.rows_times_weight(x[:rows], weight, launch).astype(mx.float32)),
                                      together[:rows])


def test_a_weights_launch_depends_on_the_weight_alone():
    # so a row's product is the same in a step, a verify and a prompt chunk
    assert list(inspect.signature(row_kernel.launch_for).parameters) == ["n", "k"]
    shapes = ((7, 64), (2048, 2048), (2048, 10752), (3072, 2048), (6144, 2048), (21504, 2048), (128000, 2048))
    launches = [row_kernel.launch_for(n, k) for n, k in shapes]
    assert [launch.warps for launch in launches] == [16, 16, 16, 16, 8, 4, 4]
    assert [launch.adjacent for launch in launches] == [False, False, True, False, False, False, False]
    assert all(launch in row_kernel.LAUNCHES for launch in launches)


@needs_cuda
def test_row_products_take_the_kernel_for_large_weights_and_few_rows(on_gpu):
    k = 1024
    weight = mx.random.normal((ROW_PRODUCT_BYTES // (2 * k) + 8, k)).astype(mx.bfloat16)
    assert served_by_rows(weight)
    x = mx.random.normal((2, 5, k)).astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(row_products(weight, x).astype(mx.float32)),
                                  np.array(row_kernel.rows_times_weight(x.reshape(10, k), weight).reshape(2, 5, -1).astype(mx.float32)))
    wide = mx.random.normal((ROW_KERNEL_ROWS + 1, k)).astype(mx.bfloat16)  # past what the kernel takes
    np.testing.assert_array_equal(np.array(row_products(weight, wide).astype(mx.float32)), np.array((wide @ weight.T).astype(mx.float32)))


def test_only_kernel_shapes_are_served():
    assert row_kernel.serves(mx.zeros((16, 64), dtype=mx.bfloat16))
    assert not row_kernel.serves(mx.zeros((16, 60), dtype=mx.bfloat16))  # rows of whole 16-byte loads only
    assert not row_kernel.serves(mx.zeros((16, 64), dtype=mx.int32))
    assert not row_kernel.serves(mx.zeros((16, 64), dtype=mx.float32))  # float32 keeps MLX's exact matmul
    large = mx.zeros((ROW_PRODUCT_BYTES // 128 + 1, 64), dtype=mx.bfloat16)
    assert served_by_rows(large) == row_kernel.available()  # the CPU keeps the matmul

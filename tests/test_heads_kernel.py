"""An attention layer's q, k and v heads by laneserve's CUDA kernel (families/lfm2/heads_kernel.py):
from a merged projection's rows it gives q and k RMS-normed per head and rotated at each
row's position (split-half pairs or interleaved), and v, all heads first, as the norms and
RoPE do within the dtype's rounding; a target and a drafter serving their heads by it run
rounds and proposals as the operations do. The kernel tests run only where MLX has its CUDA
backend; on the CPU the same rounds run through the kernel's path with the kernel emulated
as operations, and serving never takes the kernel there (tests/test_attention_kernel.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import heads_kernel
from tests.cuda import needs_cuda
from tests.test_attention_kernel import attentions, proposals, rounded, served
from tests.test_conv_kernel import run_rounds


def reference(rows, q_weight, k_weight, offsets, heads, kv_heads, width, eps, base, traditional, dtype):
    """The heads in float64, q and k normed (rounded to `dtype`) and then rotated."""
    lanes, dim = len(offsets), rows.shape[1] // (heads + 2 * kv_heads)
    x = rows.reshape(lanes, width, heads + 2 * kv_heads, dim).transpose(0, 2, 1, 3)
    half = dim // 2
    if traditional:
        first, second = np.arange(0, dim, 2), np.arange(1, dim, 2)
    else:
        first, second = np.arange(half), np.arange(half, dim)
    positions = np.array(offsets)[:, None] + np.arange(width)[None, :]  # [N, W]
    theta = positions[:, None, :, None] * base ** (-np.arange(half) / half)  # [N, 1, W, half]

    def normed_rotated(u, weight):
        u = rounded(u / np.sqrt((u**2).mean(-1, keepdims=True) + eps) * weight, dtype)
        a, b = u[..., first], u[..., second]
        out = np.empty_like(u)
        out[..., first] = a * np.cos(theta) - b * np.sin(theta)
        out[..., second] = a * np.sin(theta) + b * np.cos(theta)
        return out

    return (normed_rotated(x[:, :heads], q_weight), normed_rotated(x[:, heads : heads + kv_heads], k_weight),
            x[:, heads + kv_heads :])


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.float32, 1e-4), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("width", [1, 9, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (2, 2, 128), (3, 1, 80)])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offsets", [[0, 7, 300], [126000], [3, 3]])
def test_heads_are_normed_and_rotated_as_the_operations_do(on_gpu, dtype, tolerance, width, heads, kv_heads, dim, traditional,
                                                           offsets):
    rng = np.random.default_rng(width + heads + dim + len(offsets))
    rows = rounded(rng.standard_normal((len(offsets) * width, (heads + 2 * kv_heads) * dim)) * 3, dtype)
    q_weight, k_weight = (rounded(1 + rng.standard_normal(dim) / 4, dtype) for _ in range(2))
    eps, base = 1e-5, 1e6
    q, k, v = heads_kernel.project_heads(
        mx.array(rows).astype(dtype), mx.array(q_weight).astype(dtype), mx.array(k_weight).astype(dtype),
        mx.array(offsets, dtype=mx.int32), heads=heads, kv_heads=kv_heads, width=width, eps=eps, base=base,
        traditional=traditional)
    expected = reference(rows, q_weight, k_weight, offsets, heads, kv_heads, width, eps, base, traditional, dtype)
    for got, want in zip((q, k, v), expected):
        assert got.shape == want.shape and got.dtype == dtype
        # A float32 angle at position p is off by up to about p * 2^-24 radians, as RoPE's own is.
        slack = tolerance + max(offsets) * 2**-22
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=slack, atol=slack)
    np.testing.assert_array_equal(np.array(v.astype(mx.float32)), expected[2])
    _, k_only, _ = heads_kernel.project_heads(
        mx.array(rows).astype(dtype), mx.array(q_weight).astype(dtype), mx.array(k_weight).astype(dtype),
        mx.array(offsets, dtype=mx.int32), heads=heads, kv_heads=kv_heads, width=width, eps=eps, base=base,
        traditional=traditional, want_q=False)
    np.testing.assert_array_equal(np.array(k_only.astype(mx.float32)), np.array(k.astype(mx.float32)))


def test_shapes_it_cannot_take_are_refused():
    rows, weight, offsets = mx.zeros((6, 5 * 64)), mx.zeros((64,)), mx.zeros((2,), dtype=mx.int32)
    with pytest.raises(ValueError, match="not 2 \\+ 2 x 1 heads"):
        heads_kernel.project_heads(rows[:, :-1], weight, weight, offsets, heads=2, kv_heads=1, width=3, eps=1e-5, base=1e4,
                                   traditional=False)
    with pytest.raises(ValueError, match="6 rows for 2 lanes of 2"):
        heads_kernel.project_heads(rows[:, :4 * 64], weight, weight, offsets, heads=2, kv_heads=1, width=2, eps=1e-5,
                                   base=1e4, traditional=False)
    assert not heads_kernel.serves(False, 64) and not heads_kernel.serves(True, 63)
    assert heads_kernel.serves(True, 64) == heads_kernel.available()


def serving(dirs, by_kernel: bool):
    target, drafter = served(dirs)
    for attn in attentions(target, drafter):
        assert "qkv_proj" in attn
        attn.heads_by_kernel = by_kernel
    return target, drafter


@needs_cuda
def test_a_target_and_drafter_by_kernel_run_as_the_operations_do(on_gpu, wide_heads):
    target, drafter = serving(wide_heads, True)
    # The operations' float32 matmuls run in TF32 on the GPU; a wrong head, position or
    # layout moves logits by far more than that.
    results = [run_rounds(serving(wide_heads, by_kernel)[0]) for by_kernel in (True, False)]
    for got, expected in zip(*(logits + pools for logits, pools in results)):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    for got, expected in zip(proposals(target, drafter), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def emulated_project_heads(rows, q_weight, k_weight, offsets, *, heads, kv_heads, width, eps, base, traditional, want_q=True):
    """`heads_kernel.project_heads` as MLX operations: what the kernel computes, on any device."""
    lanes, dim = offsets.shape[0], rows.shape[1] // (heads + 2 * kv_heads)
    x = rows.reshape(lanes, width, heads + 2 * kv_heads, dim).transpose(0, 2, 1, 3)

    def normed_rotated(u, weight):
        return mx.fast.rope(mx.fast.rms_norm(u, weight, eps), dim, traditional=traditional, base=base, scale=1.0, offset=offsets)

    q = normed_rotated(x[:, :heads], q_weight) if want_q else None
    return q, normed_rotated(x[:, heads : heads + kv_heads], k_weight), x[:, heads + kv_heads :]


def test_rounds_through_the_kernel_path_equal_the_operations_on_the_cpu(wide_heads, monkeypatch):
    # The kernel's wiring (which rounds take it, rows per lane, positions, a drafter's
    # block and its context rows) checked in CI with the kernel emulated.
    calls = []

    def recorded(*args, **kw):
        calls.append((kw["width"], kw["traditional"], kw["want_q"] if "want_q" in kw else True))
        return emulated_project_heads(*args, **kw)

    monkeypatch.setattr(heads_kernel, "project_heads", recorded)
    by_kernel = serving(wide_heads, True)[0]
    kernel_logits, kernel_pools = run_rounds(by_kernel)
    ops_logits, ops_pools = run_rounds(serving(wide_heads, False)[0])
    attention_layers = sum(layer.is_attention for layer in by_kernel.model.layers)
    # The ragged prefill keeps the operations; the steady read, each step shape and the
    # verify take the kernel, each shape once (compiled rounds call it as they are traced).
    assert calls == [(w, False, True) for w in (64, 1, 5) for _ in range(attention_layers)]
    for got, expected in zip(kernel_logits + kernel_pools, ops_logits + ops_pools):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    calls.clear()
    drafting = serving(wide_heads, True)
    for layer in drafting[0].model.layers:  # the drafter's calls alone from here
        if layer.is_attention:
            layer.self_attn.heads_by_kernel = False
    drafter_layers = len(drafting[1].model.layers)
    for got, expected in zip(proposals(*drafting), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    block = drafting[1].config.width
    traditional = drafting[1].model.layers[0].self_attn.rope_traditional
    context = [c for c in calls if not c[2]]
    assert context and all(c == (1, traditional, False) for c in context)  # the appended rows' keys and values
    assert [c for c in calls if c[2]] == [(block, traditional, True)] * drafter_layers  # one trace of the block


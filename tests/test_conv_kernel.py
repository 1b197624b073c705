"""An LFM2 conv layer's gated conv as laneserve's CUDA kernel (families/lfm2/conv_kernel.py): its
windows and kept pools are exactly the operations', its gated rows equal them within the
dtype's rounding, for any slots, widths and with or without a bias; a target serving its
conv layers by the kernel runs rounds (prefill, one-row steps, a verify partly kept) as the
operations do. The kernel tests run only where MLX has its CUDA backend; on the CPU, the
target's rounds through the kernels' path (the kernels emulated as operations) equal the
operations', and serving never takes the kernels there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import Lfm2Target, conv_kernel, load_model
from tests.cuda import needs_cuda

HIDDEN, TAPS, SLOTS = 96, 3, 6


def rounded(a: np.ndarray, dtype) -> np.ndarray:
    return np.array(mx.array(a.astype(np.float32)).astype(dtype).astype(mx.float32))


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.bfloat16, 2e-2), (mx.float32, 1e-5)])
@pytest.mark.parametrize("width,keep", [(1, True), (1, False), (2, False), (9, False), (32, False), (48, False), (64, False)])
@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 0, 2, 5], [3]])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_conv_equals_the_operations(on_gpu, dtype, tolerance, width, keep, slots, with_bias):
    rng = np.random.default_rng(width * 7 + len(slots))
    lanes = len(slots)
    z = rounded(rng.standard_normal((lanes * width, 3 * HIDDEN)), dtype)
    pool = rounded(rng.standard_normal((SLOTS, TAPS - 1, HIDDEN)), dtype)
    weight = rounded(rng.standard_normal((HIDDEN, TAPS)) / 2, dtype)
    bias = rounded(rng.standard_normal(HIDDEN), dtype) if with_bias else None
    y, windows, kept = conv_kernel.gated_conv(
        mx.array(z).astype(dtype), mx.array(pool).astype(dtype), mx.array(slots, dtype=mx.int32), mx.array(weight).astype(dtype),
        None if bias is None else mx.array(bias).astype(dtype), width, keep)

    b, c, x = z[:, :HIDDEN], z[:, HIDDEN : 2 * HIDDEN], z[:, 2 * HIDDEN :]
    expected_windows = np.concatenate([pool[slots], rounded(b * x, dtype).reshape(lanes, width, HIDDEN)], axis=1)
    conv = sum(weight[:, k] * expected_windows[:, k : k + width] for k in range(TAPS)) + (0 if bias is None else bias)
    expected_y = rounded(c * rounded(conv.reshape(lanes * width, HIDDEN), dtype), dtype)
    assert y.dtype == windows.dtype == dtype
    np.testing.assert_array_equal(np.array(windows.astype(mx.float32)), expected_windows)
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), expected_y, rtol=tolerance, atol=tolerance * np.abs(expected_y).max())
    if keep:
        expected_pool = pool.copy()
        expected_pool[slots] = expected_windows[:, width:]
        np.testing.assert_array_equal(np.array(kept.astype(mx.float32)), expected_pool)
    else:
        assert kept is None


@needs_cuda
def test_rounds_it_cannot_take_are_refused(on_gpu):
    z, pool, slots = mx.zeros((65, 3 * HIDDEN)), mx.zeros((SLOTS, TAPS - 1, HIDDEN)), mx.array([0], dtype=mx.int32)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        conv_kernel.gated_conv(z, pool, slots, mx.zeros((HIDDEN, TAPS)), None, 65, False)
    with pytest.raises(ValueError, match="one-row round"):
        conv_kernel.gated_conv(z[:2], pool, slots, mx.zeros((HIDDEN, TAPS)), None, 2, True)


def run_rounds(target: Lfm2Target) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three lanes in slots 3, 0 and 2 (not contiguous, not in slot order): a ragged prefill,
    a steady read of 40 rows each (padded to 64, as a joining lane's chat prompt), two
    one-row steps, a 5-row verify kept in part, a step."""
    rng = np.random.default_rng(3)
    opened = [target.open_lane() for _ in range(4)]
    lanes = [opened[3], opened[0], opened[2]]
    logits = []
    out = target.forward(lanes, [[int(t) for t in rng.integers(15, 500, n)] for n in (7, 12, 3)], logits="last")
    target.commit(out, [7, 12, 3])
    logits.append(out.logits)
    out = target.forward(lanes, [[int(t) for t in rng.integers(15, 500, 40)] for _ in lanes], logits="last", steady=True)
    assert out.widths == [64] * 3
    target.commit(out, [40] * 3)
    logits.append(out.logits)
    for kept in ([1, 1, 1], [1, 1, 1], [2, 5, 1], [1, 1, 1]):
        width = max(kept)
        out = target.forward(lanes, [[int(t) for t in rng.integers(15, 500, width)] for _ in lanes])
        target.commit(out, kept)
        logits.append(out.logits)
        mx.eval(out.logits, *target.state_arrays())
    pools = [target.conv[i].state for i in sorted(target.conv)]
    return [np.array(a) for a in logits], [np.array(p) for p in pools]


@needs_cuda
def test_a_target_by_kernel_runs_rounds_as_the_operations_do(on_gpu, dense_dir):
    by_kernel = Lfm2Target(*load_model(dense_dir), max_lanes=4)
    by_operations = Lfm2Target(*load_model(dense_dir), max_lanes=4)
    convs = [layer.conv for layer in by_operations.model.layers if not layer.is_attention]
    assert convs and all(conv.by_kernel for conv in convs)
    for conv in convs:
        conv.by_kernel = False
    kernel_logits, kernel_pools = run_rounds(by_kernel)
    ops_logits, ops_pools = run_rounds(by_operations)
    for got, expected in zip(kernel_logits + kernel_pools, ops_logits + ops_pools):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def emulated_gated_conv(z, pool, slots, weight, bias, width, keep):
    """`conv_kernel.gated_conv` as MLX operations: what the kernel computes, on any device."""
    lanes, hidden = slots.shape[0], pool.shape[2]
    b, c, x = mx.split(z, 3, axis=-1)
    window = mx.concatenate([pool[slots], (b * x).reshape(lanes, width, hidden)], axis=1)
    conv = sum(weight[:, k] * window[:, k : k + width] for k in range(weight.shape[1]))
    conv = conv if bias is None else conv + bias
    kept = None
    if keep:
        kept = mx.array(pool)
        kept[slots] = window[:, width:]
    return c * conv.reshape(lanes * width, hidden), window, kept


def emulated_kept_states(windows, pools, slots, kept):
    """`conv_kernel.kept_states` as MLX operations."""
    span = pools[0].shape[1]
    pick = (kept[:, None] + mx.arange(span, dtype=mx.int32))[:, :, None]
    states = []
    for window, pool in zip(windows, pools):
        state = mx.array(pool)
        state[slots] = mx.take_along_axis(window, pick, axis=1)
        states.append(state)
    return states


def test_rounds_through_the_kernels_path_equal_the_operations_on_the_cpu(dense_dir, monkeypatch):
    # The kernels' wiring (which rounds take them, slot ids, the kept pool of a one-row
    # round, commit rebuilding every layer at once) checked in CI with the kernels emulated.
    widths = []
    monkeypatch.setattr(conv_kernel, "gated_conv", lambda *args: widths.append(args[5]) or emulated_gated_conv(*args))
    by_kernel = Lfm2Target(*load_model(dense_dir), max_lanes=4)
    convs = [layer.conv for layer in by_kernel.model.layers if not layer.is_attention]
    for conv in convs:
        conv.by_kernel = True
    calls = []
    monkeypatch.setattr(conv_kernel, "kept_states", lambda *args: calls.append(len(args[0])) or emulated_kept_states(*args))
    kernel_logits, kernel_pools = run_rounds(by_kernel)
    ops_logits, ops_pools = run_rounds(Lfm2Target(*load_model(dense_dir), max_lanes=4))
    assert calls == [len(convs)] * 3  # the prefill, the read and the verify, every conv layer at once
    # Every round but the ragged prefill by the kernel: the steady read, the steps and the
    # verify, each shape once (a compiled round calls it while its trace is built).
    assert widths == [w for w in (64, 1, 5) for _ in convs]
    for got, expected in zip(kernel_logits + kernel_pools, ops_logits + ops_pools):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_keeps_the_operations(dense_dir):
    target = Lfm2Target(*load_model(dense_dir), max_lanes=2, by_rows=True)
    assert not any(layer.conv.by_kernel for layer in target.model.layers if not layer.is_attention)

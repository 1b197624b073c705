"""A few query rows per lane attended straight from the KV pool by laneserve's CUDA kernel
(families/lfm2/attention_kernel.py): it equals softmax attention over the keys each row may
see (causal for the target, the whole block for a drafter), for any slots, offsets and
query groups; a target and a drafter serving their attention by it run rounds and
proposals as the operations do. The kernel tests run only where MLX has its CUDA backend;
on the CPU the same rounds run through the kernel's path with the kernel emulated as
operations, and serving never takes the kernel there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import Lfm2Target, attention_kernel, load_model
from families.lfm2.drafter import load_drafter
from families.lfm2.model import attend
from tests.cuda import needs_cuda
from tests.test_conv_kernel import run_rounds

SLOTS = 5


def reference(q, keys, values, slots, offsets, scale, causal):
    """Softmax attention in float64, row j of lane n over the keys it may see."""
    lanes, heads, rows, _ = q.shape
    group = heads // keys.shape[1]
    out = np.zeros(q.shape)
    for n in range(lanes):
        for h in range(heads):
            for j in range(rows):
                seen = offsets[n] + (j + 1 if causal else rows)
                k, v = keys[slots[n], h // group, :seen], values[slots[n], h // group, :seen]
                scores = k @ q[n, h, j] * scale
                weights = np.exp(scores - scores.max())
                out[n, h, j] = weights @ v / weights.sum()
    return out


def rounded(a: np.ndarray, dtype) -> np.ndarray:
    return np.array(mx.array(a.astype(np.float32)).astype(dtype).astype(mx.float32), dtype=np.float64)


@needs_cuda
@pytest.mark.parametrize("dtype,tolerance", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 9, 32, 64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 1, 32), (2, 2, 128)])
@pytest.mark.parametrize("slots,offsets", [([0, 1, 2], [0, 5, 40]), ([4, 0, 3], [700, 3, 291]), ([2], [1000 - 64])])
def test_kernel_attends_what_each_row_may_see(on_gpu, dtype, tolerance, rows, causal, heads, kv_heads, dim, slots, offsets):
    rng = np.random.default_rng(rows + heads + len(slots))
    capacity = 1024  # keys past a row's reach hold noise the kernel must never read
    q = rounded(rng.standard_normal((len(slots), heads, rows, dim)), dtype)
    keys = rounded(rng.standard_normal((SLOTS, kv_heads, capacity, dim)), dtype)
    values = rounded(rng.standard_normal((SLOTS, kv_heads, capacity, dim)), dtype)
    scale = dim**-0.5
    o = attention_kernel.pool_attention(mx.array(q).astype(dtype), mx.array(keys).astype(dtype), mx.array(values).astype(dtype),
                                        mx.array(slots, dtype=mx.int32), mx.array(offsets, dtype=mx.int32), scale, causal)
    assert o.shape == q.shape and o.dtype == dtype
    expected = reference(q, keys, values, slots, offsets, scale, causal)
    np.testing.assert_allclose(np.array(o.astype(mx.float32)), expected, rtol=tolerance, atol=tolerance)


@needs_cuda
def test_rows_it_cannot_take_are_refused(on_gpu):
    q, pool = mx.zeros((1, 2, 65, 32)), mx.zeros((1, 2, 128, 32))
    with pytest.raises(ValueError, match="1 to 64 rows"):
        attention_kernel.pool_attention(q, pool, pool, mx.array([0]), mx.array([0]), 1.0, True)


def test_which_rounds_and_shapes_take_it():
    assert attention_kernel.takes(1, 9, 1024) and attention_kernel.takes(3, 32, attention_kernel.MAX_KEYS)
    assert attention_kernel.takes(1, 64, 1024)  # a joining lane's chat prompt, read padded to 64 rows
    assert attention_kernel.takes(2, 1, 256) and attention_kernel.takes(16, 1, attention_kernel.MAX_KEYS)
    assert not attention_kernel.takes(1, 1, 256)  # one lane's step keeps the backend's decoding kernel
    assert not attention_kernel.takes(1, 65, 256) and not attention_kernel.takes(4, 9, attention_kernel.MAX_KEYS + 1)
    assert not attention_kernel.takes(16, 1, attention_kernel.MAX_KEYS + 1)
    if attention_kernel.available():
        assert attention_kernel.serves(32, 8, 64) and attention_kernel.serves(4, 2, 32)
    assert not attention_kernel.serves(4, 2, 16) and not attention_kernel.serves(64, 1, 128)


def proposals(target: Lfm2Target, drafter) -> list[np.ndarray]:
    """Two rounds of greedy proposals for three lanes in slots 2, 0 and 1."""
    prompts = [[5, 9, 23, 7, 1, 44], [3, 3, 3], [60, 2, 31, 31, 8, 19, 4, 11, 200, 17]]
    opened = [drafter.open_lane() for _ in range(3)]
    lanes = [opened[2], opened[0], opened[1]]
    taps = []
    for prompt in prompts:
        _, rows = target.prefill(target.open_lane(), prompt, chunk=8, taps=drafter.tap_layers)
        taps.append(rows)
    drafter.append(lanes, taps, prompts)
    out = []
    for _ in range(2):
        proposal = drafter.propose(lanes, [p[-1] for p in prompts], chain_logits=True)
        mx.eval(*proposal.arrays())
        out += [np.array(proposal.tokens), np.array(proposal.logits)]
        drafter.append(lanes[:1], [taps[0][-1:]], [[prompts[0][-1]]])  # one lane's context moves on
    return out


def served(dirs) -> tuple[Lfm2Target, object]:
    """A float32 target and drafter from `dirs`, each serving as the CPU does."""
    target_dir, drafter_dir = dirs
    model, cfg = load_model(target_dir, dtype="float32")
    return Lfm2Target(model, cfg, max_lanes=4), load_drafter(drafter_dir, model, cfg, dtype="float32", max_lanes=3)


def attentions(target: Lfm2Target, drafter) -> list:
    """Every attention module of the target and the drafter."""
    return [layer.self_attn for layer in target.model.layers if layer.is_attention] + [layer.self_attn for layer in drafter.model.layers]


def serving(dirs, by_kernel: bool):
    target, drafter = served(dirs)
    for attn in attentions(target, drafter):
        attn.by_kernel = by_kernel
    return target, drafter


@needs_cuda
def test_a_target_and_drafter_by_kernel_run_as_the_operations_do(on_gpu, wide_heads):
    target, drafter = serving(wide_heads, True)
    assert attention_kernel.serves(4, 2, 32)
    # The operations' float32 matmuls run in TF32 on the GPU (about 1e-3 of a logit's
    # scale); the kernel multiplies in float32. A wrong key, slot or mask moves logits by
    # far more.
    results = [run_rounds(serving(wide_heads, by_kernel)[0]) for by_kernel in (True, False)]
    for got, expected in zip(*(logits + pools for logits, pools in results)):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
    for got, expected in zip(proposals(target, drafter), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


def emulated_pool_attention(q, keys, values, slots, offsets, scale, causal):
    """`attention_kernel.pool_attention` as MLX operations: what the kernel computes, on any device."""
    rows, capacity = q.shape[2], keys.shape[2]
    seen = offsets[:, None] + (mx.arange(1, rows + 1)[None, :] if causal else rows)
    visible = mx.arange(capacity)[None, None, :] < seen[:, :, None]
    return attend(q, keys[slots], values[slots], scale, visible[:, None])


def test_rounds_through_the_kernel_path_equal_the_operations_on_the_cpu(wide_heads, monkeypatch):
    # The kernel's wiring (which rounds take it, slots, offsets, causal or whole-block
    # sight, the output's layout) checked in CI with the kernel emulated.
    calls = []
    monkeypatch.setattr(attention_kernel, "pool_attention", lambda *args, **kw: calls.append(kw["causal"]) or emulated_pool_attention(*args, **kw))
    by_kernel = serving(wide_heads, True)[0]
    kernel_logits, kernel_pools = run_rounds(by_kernel)
    target_calls = len(calls)
    ops_logits, ops_pools = run_rounds(serving(wide_heads, False)[0])
    attention_layers = sum(layer.is_attention for layer in by_kernel.model.layers)
    # the 12-row prefill, the 64-row steady read, three one-row steps of the three lanes and the 5-row verify
    assert calls == [True] * 6 * attention_layers and target_calls == len(calls)
    for got, expected in zip(kernel_logits + kernel_pools, ops_logits + ops_pools):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    calls.clear()
    drafting = serving(wide_heads, True)
    for got, expected in zip(proposals(*drafting), proposals(*serving(wide_heads, False))):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert calls.count(False) == 2 * len(drafting[1].model.layers)  # two proposals, the block seen whole


def test_the_cpu_keeps_the_operations(wide_heads):
    # Neither this kernel, nor the heads and residual kernels, ever serve on the CPU.
    target_dir, drafter_dir = wide_heads
    model, cfg = load_model(target_dir, dtype="float32")
    Lfm2Target(model, cfg, max_lanes=2, by_rows=True)
    drafter = load_drafter(drafter_dir, model, cfg, dtype="float32", max_lanes=2, by_rows=True)
    attentions = [layer.self_attn for layer in model.layers if layer.is_attention] + [layer.self_attn for layer in drafter.model.layers]
    assert not any(attn.by_kernel or attn.heads_by_kernel for attn in attentions)
    assert not model.residual_by_kernel and not drafter.residual_by_kernel

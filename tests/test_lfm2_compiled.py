"""The serving layout of the target and drafter: merged projections compute what the
checkpoint's separate ones do, and compiled rounds and proposals equal eager ones step for
step (float32, CPU), including across key-span buckets, out-of-order and non-contiguous
slots, verify windows with partial accepts, rounds fed the previous round's lazy choices,
and proposals with a host-side pick or without their chain logits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from families.lfm2 import Lfm2Target, load_model
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny_drafter import make_tiny_drafter
from tests.test_lfm2_rounds import lane_state

TAPS = (1, 3)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(15, 500, n)]


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
@pytest.mark.parametrize("quantized", [False, True])
def test_merged_projections_compute_the_separate_ones(checkpoint, quantized, request):
    model, _ = load_model(request.getfixturevalue(checkpoint))
    if quantized:
        nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    prompt = mx.array([tokens(0, 40)])
    separate, separate_taps = model(prompt, taps=TAPS)
    model.merge_projections()
    merged, merged_taps = model(prompt, taps=TAPS)
    names = {name for name, _ in nn.utils.tree_flatten(model.parameters())}
    assert any(".self_attn.qkv_proj." in n for n in names) and any(".w13." in n for n in names)
    assert not any(".self_attn.q_proj." in n or ".w1." in n for n in names)
    np.testing.assert_allclose(np.array(merged), np.array(separate), rtol=1e-5, atol=1e-5)
    for a, b in zip(merged_taps, separate_taps):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


def test_differently_quantized_projections_stay_separate(dense_dir):
    model, _ = load_model(dense_dir)
    attention = next(layer.self_attn for layer in model.layers if layer.is_attention)
    attention.q_proj = nn.QuantizedLinear.from_linear(attention.q_proj, group_size=32, bits=8)
    attention.k_proj = nn.QuantizedLinear.from_linear(attention.k_proj, group_size=32, bits=4)
    prompt = mx.array([tokens(0, 12)])
    before, _ = model(prompt)
    model.merge_projections()
    assert "q_proj" in attention and "qkv_proj" not in attention
    after, _ = model(prompt)
    np.testing.assert_allclose(np.array(after), np.array(before), rtol=1e-5, atol=1e-5)


def pair(path, lanes=4):
    """The same checkpoint served eagerly and compiled."""
    targets = []
    for compiled in (False, True):
        model, config = load_model(path)
        targets.append(Lfm2Target(model, config, max_lanes=lanes, compiled=compiled))
    return targets


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_compiled_decode_equals_eager_across_span_buckets(checkpoint, request):
    """Four lanes, given out of slot order, decode greedily past a key-span bucket and a
    KV pool growth, each round fed the previous round's unread choices: logits, taps,
    tokens and caches match."""
    eager, compiled = pair(request.getfixturevalue(checkpoint))
    contexts = [250, 9, 30, 253]  # the key span's first bucket is 256 keys
    order = [2, 0, 3, 1]
    runs = []
    for target in (eager, compiled):
        lanes = [target.open_lane() for _ in contexts]
        firsts = [target.prefill(lane, tokens(i, n))[0] for i, (lane, n) in enumerate(zip(lanes, contexts))]
        fed = mx.argmax(mx.stack([firsts[i] for i in order]), axis=-1)
        steps = []
        for _ in range(10):
            out = target.forward([lanes[i] for i in order], fed, taps=TAPS, key_bucket=4)
            fed = mx.argmax(out.logits, axis=-1)
            target.commit(out, [1] * len(order))
            mx.eval(fed, out.taps, *target.state_arrays())
            steps.append((np.array(out.logits), np.array(out.taps), fed.tolist()))
        runs.append((steps, [lane_state(target, lane) for lane in lanes]))
    (eager_steps, eager_state), (compiled_steps, compiled_state) = runs
    for (logits_e, taps_e, fed_e), (logits_c, taps_c, fed_c) in zip(eager_steps, compiled_steps):
        assert fed_c == fed_e
        np.testing.assert_allclose(logits_c, logits_e, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(taps_c, taps_e, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(compiled_state, eager_state):
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-5, err_msg=name)
    decode_traces = [spec for spec in compiled._traces.specs() if spec.widths == (1,) * len(order)]
    # One trace per segment: the key span grew past a bucket, yet nothing was traced again.
    assert len(decode_traces) == len(compiled.config.attention_layers) + 1


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_compiled_verify_windows_and_partial_accepts_equal_eager(checkpoint, request):
    """Uniform windows of 5 rows over non-contiguous slots, partial accepts, then plain
    steps from where each lane stopped."""
    eager, compiled = pair(request.getfixturevalue(checkpoint), lanes=5)
    results = []
    for target in (eager, compiled):
        slots = [target.open_lane() for _ in range(5)]
        target.close_lane(slots[1])  # lanes at slots 0, 2, 4: a gather, not a slice
        target.close_lane(slots[3])
        lanes = [slots[4], slots[0], slots[2]]
        for i, lane in enumerate(lanes):
            target.prefill(lane, tokens(20 + i, 11 + 7 * i))
        logs = []
        for round_ in range(3):
            windows = [tokens(100 * round_ + i, 5) for i in range(len(lanes))]
            out = target.forward(lanes, windows, taps=TAPS)
            target.commit(out, [1 + (round_ + i) % 5 for i in range(len(lanes))])
            step = target.forward(lanes, [[w[0]] for w in windows])
            target.commit(step, [1] * len(lanes))
            mx.eval(out.logits, out.taps, step.logits, *target.state_arrays())
            logs += [np.array(out.logits), np.array(out.taps), np.array(step.logits)]
        results.append((logs, [lane_state(target, lane) for lane in lanes]))
    (eager_logs, eager_state), (compiled_logs, compiled_state) = results
    for ours, theirs in zip(compiled_logs, eager_logs):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(compiled_state, eager_state):
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_compiled_steady_prompt_reads_equal_eager(checkpoint, request):
    """Steady prompt reads wider than a verify window (lanes joining on slots an ended
    lane left, then one lane's long chunk), each lane's last row's logits and the taps,
    then decode steps from where each prompt ended: compiled matches eager, and the reads
    ran as traces of their padded widths."""
    eager, compiled = pair(request.getfixturevalue(checkpoint), lanes=4)
    prompts = [tokens(40, 37), tokens(41, 50), tokens(42, 100)]
    results = []
    for target in (eager, compiled):
        slots = [target.open_lane() for _ in range(4)]
        target.close_lane(slots[0])  # the joining lanes sit on slots 1 and 3: slot ids
        target.close_lane(slots[2])
        lanes = [slots[3], slots[1]]
        logs = []
        read = target.forward(lanes, prompts[:2], logits="last", taps=TAPS, steady=True)
        target.commit(read, [len(p) for p in prompts[:2]])
        long_read = target.forward([lanes[0]], [prompts[2]], logits="last", taps=TAPS, steady=True)
        target.commit(long_read, [len(prompts[2])])
        fed = mx.argmax(long_read.logits, axis=-1)
        mx.eval(read.logits, read.taps, long_read.logits, long_read.taps, *target.state_arrays())
        logs += [np.array(read.logits), np.array(read.taps), np.array(long_read.logits), np.array(long_read.taps)]
        fed = mx.concatenate([fed, mx.argmax(read.logits[1:], axis=-1)])
        for _ in range(3):
            step = target.forward(lanes, fed, taps=TAPS)
            fed = mx.argmax(step.logits, axis=-1)
            target.commit(step, [1, 1])
            mx.eval(fed, *target.state_arrays())
            logs.append(np.array(step.logits))
        results.append((logs, [lane_state(target, lane) for lane in lanes]))
    (eager_logs, eager_state), (compiled_logs, compiled_state) = results
    for ours, theirs in zip(compiled_logs, eager_logs):
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(compiled_state, eager_state):
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-5, err_msg=name)
    read_widths = {spec.widths for spec in compiled._traces.specs()} - {(1, 1)}
    assert read_widths == {(64, 64), (128,)}


def test_an_uncommitted_step_leaves_the_conv_state(dense_dir):
    """A one-row forward builds its conv pools with the row kept, but only commit swaps
    them in; a round committed in between makes commit rebuild them from the windows."""
    model, config = load_model(dense_dir)
    target = Lfm2Target(model, config, max_lanes=2)
    lane, other = target.open_lane(), target.open_lane()
    target.prefill(lane, tokens(1, 20))
    target.prefill(other, tokens(2, 20))
    before = lane_state(target, lane)
    target.forward([lane], [[5]])  # a rehearsal: never committed
    mx.eval(target.state_arrays())
    for name, value in lane_state(target, lane).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)

    first = target.forward([lane], [[5]])
    step_other = target.forward([other], [[6]])
    target.commit(step_other, [1])
    target.commit(first, [1])  # after another commit: rebuilt from its windows
    mx.eval(target.state_arrays())

    reference_model, _ = load_model(dense_dir)
    reference = Lfm2Target(reference_model, config, max_lanes=2, compiled=False)
    ref_lane, ref_other = reference.open_lane(), reference.open_lane()
    reference.prefill(ref_lane, tokens(1, 20))
    reference.prefill(ref_other, tokens(2, 20))
    for lane_, ref, token in ((lane, ref_lane, 5), (other, ref_other, 6)):
        reference.commit(reference.forward([ref], [[token]]), [1])
        ours, theirs = lane_state(target, lane_), lane_state(reference, ref)
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-5, err_msg=name)


# --- the drafter ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_pair(tmp_path_factory, dense_dir):
    """The same drafter served eagerly and compiled, on one target model."""
    path = make_tiny_drafter(tmp_path_factory.mktemp("drafter"), dense_dir, seed=3, taps=list(TAPS))
    model, config = load_model(dense_dir)
    return [load_drafter(path, model, config, max_lanes=4, compiled=compiled) for compiled in (False, True)]


def sampled_pick(logits: mx.array, k: int) -> mx.array:
    """A host-side pick standing in for a sampler: never traced."""
    return mx.argmax(logits + mx.array(np.random.default_rng(k).gumbel(size=logits.shape).astype(np.float32)), axis=-1)


@pytest.mark.parametrize("pick", [None, sampled_pick])
def test_compiled_proposals_equal_eager(drafter_pair, pick):
    """Three lanes at non-contiguous slots with ragged contexts, two rounds (appends in
    between, the key span growing past a bucket): tokens, confidences, chain logits and
    faults match; without the chain logits the same tokens, confidences and faults come
    back."""
    rng = np.random.default_rng(0)
    contexts, width = [251, 19, 12], len(TAPS) * 64  # lane 0's keys cross 256 in the second round
    results = []
    for drafter in drafter_pair:
        slots = [drafter.open_lane() for _ in range(4)]
        drafter.close_lane(slots[1])
        lanes = [slots[3], slots[0], slots[2]]
        rows = [mx.array(rng.standard_normal((n, width)).astype(np.float32)) for n in contexts]
        drafter.append(lanes, rows, [[0] * n for n in contexts])
        log = []
        for round_ in range(2):
            full = drafter.propose(lanes, [30 + round_, 40, 50], pick=pick)
            lean = drafter.propose(lanes, [30 + round_, 40, 50], pick=pick, chain_logits=False)
            mx.eval(full.arrays(), lean.arrays())
            assert lean.logits is None
            np.testing.assert_array_equal(np.array(lean.tokens), np.array(full.tokens))
            np.testing.assert_array_equal(np.array(lean.confidences), np.array(full.confidences))
            assert lean.faults.tolist() == full.faults.tolist() == [0, 0, 0]
            log.append([np.array(a) for a in full.arrays()])
            more = [mx.array(rng.standard_normal((n, width)).astype(np.float32)) for n in (3, 1, 2)]
            drafter.append(lanes, more, [[0] * m.shape[0] for m in more])
        results.append(log)
        for lane in lanes:
            drafter.close_lane(lane)
        rng = np.random.default_rng(0)
    compiled = drafter_pair[1]
    traced = [spec for spec in compiled._segments.specs() if spec.lanes == 3 and spec.greedy == (pick is None)]
    # One trace per segment, with and without the chain logits; the contexts' growth retraced nothing.
    assert len(traced) == 2 * (len(compiled.kv) + 1)
    for eager_round, compiled_round in zip(*results):
        (tokens_e, *floats_e), (tokens_c, *floats_c) = eager_round, compiled_round
        np.testing.assert_array_equal(tokens_c, tokens_e)
        for ours, theirs in zip(floats_c, floats_e):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_poisoned_lane_faults_without_chain_logits(drafter_pair):
    _, drafter = drafter_pair
    rows = [mx.ones((5, len(TAPS) * 64)), mx.full((4, len(TAPS) * 64), float("nan"))]
    lanes = [drafter.open_lane() for _ in rows]
    drafter.append(lanes, rows, [[0] * r.shape[0] for r in rows])
    proposal = drafter.propose(lanes, [30, 40], chain_logits=False)
    mx.eval(proposal.arrays())
    errors = drafter.validate(proposal)
    assert errors[0] is None and "NaN" in str(errors[1])
    for lane in lanes:
        drafter.close_lane(lane)

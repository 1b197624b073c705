"""Shared ragged rounds, rollback after a partial accept, and chunked prefill: each must
leave every lane exactly where running it alone, step by step, would."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import Lfm2Target, load_model
from families.lfm2.cache import RaggedLayout

TAPS = (1, 3)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(15, 500, n)]


def fresh_target(path, lanes=4):
    model, config = load_model(path)
    target = Lfm2Target(model, config, max_lanes=lanes)
    return target


def lane_state(target, lane) -> dict[str, np.ndarray]:
    """The committed part of a lane's caches."""
    state = {}
    committed = RaggedLayout([1], [lane.length - 1])  # spans exactly the committed rows
    for i, pool in target.kv.items():
        keys, values = pool.read([lane.slot], committed)
        state[f"k{i}"], state[f"v{i}"] = np.array(keys), np.array(values)
    for i, pool in target.conv.items():
        state[f"conv{i}"] = np.array(pool.read([lane.slot], committed))
    return state


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_ragged_round_equals_each_lane_alone(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    contexts = [5, 31, 12, 20]
    rows = [1, 4, 7, 2]
    prompts = [tokens(i, n) for i, n in enumerate(contexts)]
    feeds = [tokens(10 + i, w) for i, w in enumerate(rows)]

    shared = fresh_target(path)
    lanes = [shared.open_lane() for _ in prompts]
    for lane, prompt in zip(lanes, prompts):
        shared.prefill(lane, prompt)
    # Lanes given out of slot order exercise the reordering as well.
    order = [2, 0, 3, 1]
    out = shared.forward([lanes[i] for i in order], [feeds[i] for i in order], taps=TAPS)
    shared.commit(out, [rows[i] for i in order])
    mx.eval(out.logits, out.taps)

    for position, i in enumerate(order):
        alone = fresh_target(path, lanes=1)
        lane = alone.open_lane()
        alone.prefill(lane, prompts[i])
        solo = alone.forward([lane], [feeds[i]], taps=TAPS)
        alone.commit(solo, [rows[i]])
        start, width = out.row_starts[position], out.widths[position]
        np.testing.assert_allclose(np.array(out.logits[start : start + width]), np.array(solo.logits), atol=1e-4)
        np.testing.assert_allclose(np.array(out.taps[start : start + width]), np.array(solo.taps), atol=1e-4)
        theirs, ours = lane_state(alone, lane), lane_state(shared, lanes[i])
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_partial_accept_rolls_back_to_plain_decode(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    prompt, window, keep = tokens(1, 23), tokens(2, 6), 3

    verified = fresh_target(path, lanes=2)
    other = verified.open_lane()  # a neighbour whose full window is kept
    lane = verified.open_lane()
    verified.prefill(other, tokens(3, 9))
    verified.prefill(lane, prompt)
    out = verified.forward([lane, other], [window, tokens(4, 6)])
    verified.commit(out, [keep, 6])

    plain = fresh_target(path, lanes=1)
    solo = plain.open_lane()
    plain.prefill(solo, prompt)
    for token in window[:keep]:
        plain.commit(plain.forward([solo], [[token]]), [1])

    assert lane.length == solo.length == len(prompt) + keep
    theirs, ours = lane_state(plain, solo), lane_state(verified, lane)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)
    # And the next step, which reads the rebuilt state, agrees too.
    following = tokens(5, 1)
    ours = verified.forward([lane], [following])
    theirs = plain.forward([solo], [following])
    np.testing.assert_allclose(np.array(ours.logits), np.array(theirs.logits), atol=1e-4)


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_chunked_prefill_equals_one_shot(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    prompt = tokens(7, 70)
    results = []
    for chunk in (1000, 16, 7):
        target = fresh_target(path, lanes=1)
        lane = target.open_lane()
        last, taps = target.prefill(lane, prompt, chunk=chunk, taps=TAPS)
        results.append((np.array(last), np.array(taps), lane_state(target, lane)))
    one_shot = results[0]
    for last, taps, state in results[1:]:
        np.testing.assert_allclose(last, one_shot[0], atol=1e-4)
        assert taps.shape == (len(prompt), len(TAPS) * 64)
        np.testing.assert_allclose(taps, one_shot[1], atol=1e-4)
        for name in state:
            np.testing.assert_allclose(state[name], one_shot[2][name], atol=1e-5, err_msg=name)


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_lazy_rows_in_any_lane_order_equal_host_rows(checkpoint, request):
    # A drafted round feeds its verify rows as one lazy array (drafts the host has not
    # read), lanes in the caller's order, which need not be slot order.
    path = request.getfixturevalue(checkpoint)
    target = fresh_target(path, lanes=3)
    slots = [target.open_lane() for _ in range(3)]
    for i, slot in enumerate(slots):
        target.prefill(slot, tokens(60 + i, 5 + 3 * i))
    caller = [slots[2], slots[0], slots[1]]
    rows = [tokens(70 + i, 4) for i in range(3)]
    listed = target.forward(caller, rows, taps=(1,))
    lazy = target.forward(caller, mx.array([t for r in rows for t in r]), widths=[4, 4, 4], taps=(1,))
    np.testing.assert_allclose(np.array(lazy.logits), np.array(listed.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(lazy.taps), np.array(listed.taps), rtol=1e-5, atol=1e-5)
    assert lazy.row_starts == listed.row_starts == [0, 4, 8]


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_steady_prompt_reads_equal_ragged_ones(checkpoint, request):
    # Prompt chunks padded to one steady width (so a backend that plans per shape meets a
    # few shapes) keep exactly what the ragged read keeps: last rows' logits, the taps of
    # every own row, the caches, and the step after. Lanes out of slot order, one lane
    # part-way through its prompt, and widths the padding must decline.
    path = request.getfixturevalue(checkpoint)
    started = tokens(40, 9)
    chunks = [tokens(41, 5), tokens(42, 3), tokens(43, 4)]

    def read(steady: bool, chunks):
        target = fresh_target(path, lanes=3)
        lanes = [target.open_lane() for _ in chunks]
        target.prefill(lanes[1], started)
        order = [2, 0, 1]
        out = target.forward([lanes[i] for i in order], [chunks[i] for i in order], logits="last", taps=TAPS, steady=steady)
        target.commit(out, [len(chunks[i]) for i in order])
        taps = [np.array(out.taps[s : s + len(chunks[i])]) for s, i in zip(out.row_starts, order)]
        step = target.forward(lanes, [[7], [8], [9]])
        mx.eval(out.logits, step.logits)
        return out, np.array(out.logits), taps, [lane_state(target, lane) for lane in lanes], np.array(step.logits)

    ragged, steady = read(False, chunks), read(True, chunks)
    assert ragged[0].widths == [4, 5, 3] and steady[0].widths == [8, 8, 8]
    np.testing.assert_allclose(steady[1], ragged[1], atol=1e-4)
    for ours, theirs in zip(steady[2], ragged[2]):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)
    for ours, theirs in zip(steady[3], ragged[3]):
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(steady[4], ragged[4], atol=1e-4)
    # A long chunk beside short ones would more than double the rows: read as it is.
    assert read(True, [tokens(44, 40), tokens(45, 2), tokens(46, 3)])[0].widths == [3, 40, 2]


def test_steady_prompt_reads_stop_short_of_the_context_limit(dense_dir):
    target = fresh_target(dense_dir, lanes=1)
    lane = target.open_lane()
    target.prefill(lane, tokens(47, target.context_limit - 40))
    out = target.forward([lane], [tokens(48, 33)], logits="last", steady=True)  # 64 rows would pass the limit
    assert out.widths == [33]
    target.commit(out, [33])
    assert lane.length == target.context_limit - 7

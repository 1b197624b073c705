"""The readback: a round's host reads packed into kept boxes (lanes/readback.py)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from lanes.readback import MAX_BOXES, MIN_CAPACITY, SMALL_POOL_SLOTS, Readback


def address(a: mx.array) -> int:
    mx.eval(a)
    return np.array(a, copy=False).__array_interface__["data"][0]


def test_arrays_come_back_with_their_shapes_values_and_bits():
    rb = Readback()
    ints = mx.arange(12, dtype=mx.int32).reshape(3, 4) - 5
    floats = mx.array([[0.25, math.nan], [-math.inf, 1e-30]], dtype=mx.float32)
    flags = mx.array([True, False, True])
    big = mx.array([2**32 - 1, 7], dtype=mx.uint32)
    posted = rb.post([ints, floats, flags, big])
    got = rb.read(posted)
    assert [g.shape for g in got] == [(3, 4), (2, 2), (3,), (2,)]
    assert got[0].tolist() == ints.tolist()
    assert got[1].dtype == np.float32 and got[1].tobytes() == np.array(floats).tobytes()
    assert got[2].tolist() == [1, 0, 1]
    assert got[3].dtype == np.uint32 and got[3].tolist() == [2**32 - 1, 7]


def test_a_box_is_rewritten_in_place_once_read():
    rb = Readback()
    addresses = set()
    for i in range(6):
        posted = rb.post([mx.arange(5) + i])
        addresses.add((posted.box, address(rb.boxes[posted.box])))
        assert rb.read(posted)[0].tolist() == list(range(i, i + 5))
    assert len(addresses) == 1  # one box, its buffer donated to every update


def test_posts_waiting_unread_take_boxes_of_their_own():
    rb = Readback()
    first, second = rb.post([mx.array([1, 2, 3])]), rb.post([mx.array([4, 5, 6])])
    assert first.box != second.box
    assert rb.read(second)[0].tolist() == [4, 5, 6] and rb.read(first)[0].tolist() == [1, 2, 3]
    third = rb.post([mx.array([7, 8, 9])])
    assert third.box in (first.box, second.box) and rb.read(third)[0].tolist() == [7, 8, 9]


def test_a_post_never_read_is_taken_back_when_every_box_is_in_use():
    rb = Readback()
    posts = [rb.post([mx.array([i, i, i])]) for i in range(MAX_BOXES + 1)]
    assert len(rb.boxes) == MAX_BOXES and posts[-1].box == posts[0].box
    with pytest.raises(RuntimeError, match="taken back before this post was read"):
        rb.read(posts[0])
    assert [rb.read(p)[0].tolist() for p in posts[1:]] == [[i] * 3 for i in range(1, MAX_BOXES + 1)]
    with pytest.raises(RuntimeError, match="taken back"):
        rb.read(posts[1])  # read already


def test_a_post_small_enough_for_the_mapped_pool_skips_the_boxes():
    rb = Readback()
    posted = rb.post([mx.array([7]), mx.array([0.5], dtype=mx.float32)][:SMALL_POOL_SLOTS])
    assert posted.box is None and rb.boxes == []
    token, confidence = rb.read(posted)
    assert token.tolist() == [7] and confidence.tolist() == [0.5]


def test_a_box_grows_for_a_larger_post():
    rb = Readback()
    big = mx.arange(MIN_CAPACITY * 3, dtype=mx.int32)
    posted = rb.post([big, mx.array([9])])
    assert rb.boxes[posted.box].shape[0] == MIN_CAPACITY * 4
    small, tail = rb.read(posted)
    assert small.tolist() == big.tolist() and tail.tolist() == [9]

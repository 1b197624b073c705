"""A round's host reads, packed into one array that is never freed.

On CUDA, MLX (0.32) gives a device array the host reads a managed copy (cudaMallocManaged,
a copy, then a cudaFree that synchronises), and a freed buffer goes back to the one cache
that hands buffers out by size alone: a later kernel whose output lands on a page the
host touched waits while the page migrates. `bench.host_traffic` measured such kernels
at 8-10x their device time (bench/results/README.md, "Small kernels that wait"). So a
round posts everything it will read (token ids, draft confidences, fault bits) into a
kept int32 box, and the host reads that box once. Writing into a box nothing else holds
reuses its buffer (MLX donates it to the update), so after the first read the host reads
the same managed pages every round and no buffer it touched returns to the cache.

A post of at most 8 bytes (one lane's token) skips the box: MLX makes arrays that small in
a managed pool the device maps instead of migrating, which costs the kernels nothing.

A box is rewritten only once its post has been read, so there are as many boxes as
posts wait unread at once: two where a plain round is posted before the round ahead
of it is read. A post never read (a round dropped) holds its box until MAX_BOXES are
in use; then the oldest post's box is taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MAX_BOXES = 4
MIN_CAPACITY = 1024  # int32 slots; a box grows by doubling
SMALL_POOL_SLOTS = 2  # int32 slots MLX's CUDA allocator takes from its mapped small pool


@dataclass(frozen=True, eq=False)
class Posted:
    """What a post's arrays are packed into (a box, or for a small post `direct`), and
    their shapes and dtypes, in order."""

    box: int | None
    serial: int  # posts in order: the oldest unread is taken back first
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[mx.Dtype, ...]
    direct: mx.array | None = None


def as_int32(a: mx.array) -> mx.array:
    """`a` flattened as int32 slots: 4-byte values keep their bits, others are cast."""
    if a.dtype in (mx.int32, mx.uint32, mx.float32):
        return a.reshape(-1).view(mx.int32)
    return a.reshape(-1).astype(mx.int32)


class Readback:
    """The kept boxes, and the post each holds until it is read."""

    def __init__(self):
        self.boxes: list[mx.array] = []
        self.unread: list[Posted | None] = []  # per box: its post, until read
        self.serial = 0

    def _free_box(self) -> int:
        for box, post in enumerate(self.unread):
            if post is None:
                return box
        if len(self.boxes) < MAX_BOXES:
            self.boxes.append(mx.zeros((MIN_CAPACITY,), mx.int32))
            self.unread.append(None)
            return len(self.boxes) - 1
        return min(range(len(self.unread)), key=lambda box: self.unread[box].serial)

    def post(self, arrays: list[mx.array]) -> Posted:
        """Pack `arrays` (lazy, int or float32, any shapes; others are cast to int32)
        into a free box; evaluate `pending(posted)` (with the rest of the round) before
        `read`."""
        packed = mx.concatenate([as_int32(a) for a in arrays]) if arrays else mx.zeros((0,), mx.int32)
        n = packed.shape[0]
        shapes, dtypes = tuple(tuple(a.shape) for a in arrays), tuple(a.dtype for a in arrays)
        self.serial += 1
        if n <= SMALL_POOL_SLOTS:
            return Posted(None, self.serial, shapes, dtypes, direct=packed)
        box = self._free_box()
        capacity = self.boxes[box].shape[0]
        if capacity < n:
            while capacity < n:
                capacity *= 2
            self.boxes[box] = mx.zeros((capacity,), mx.int32)
        self.boxes[box][:n] = packed  # in place: the old box is held by nothing else
        posted = Posted(box, self.serial, shapes, dtypes)
        self.unread[box] = posted
        return posted

    def pending(self, posted: Posted) -> mx.array:
        """The array to evaluate before `read`."""
        return posted.direct if posted.direct is not None else self.boxes[posted.box]

    def read(self, posted: Posted) -> list[np.ndarray]:
        """The posted arrays on the host, as numpy arrays of their shapes and dtypes (4-byte
        types as posted, others as int32). Evaluates the box if it is not yet."""
        sizes = [int(np.prod(shape)) for shape in posted.shapes]
        if posted.direct is not None:
            host = np.array(posted.direct)
        else:
            if self.unread[posted.box] is not posted:
                raise RuntimeError(f"readback box {posted.box} was taken back before this post was read")
            self.unread[posted.box] = None
            # No lazy slice: one would queue behind the rounds launched since and wait for
            # them. The view is dropped at once, leaving the box to the next update.
            host = np.array(self.boxes[posted.box], copy=False)[: sum(sizes)].copy()
        out, at = [], 0
        for shape, dtype, size in zip(posted.shapes, posted.dtypes, sizes):
            part = host[at : at + size]
            out.append((part.view(np.float32) if dtype == mx.float32 else part.view(np.uint32) if dtype == mx.uint32 else part).reshape(shape))
            at += size
        return out

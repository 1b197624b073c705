"""Getting a round runner ready to serve: a rehearsal of every round path, every steady
shape run once, and the cost table seeded by a short profile.

A backend may build something the first time it meets a shape (CUDA's cuBLASLt plans
each new matmul shape; kernels compile on first use): paid inside a round the guard
times, that would decide a band on its own. So every path and shape runs here first,
and what the rehearsal would teach (guard evidence, calibration, costs, counters) goes
to throwaway instances.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from .counters import RoundCounters
from .guard import DraftGuard
from .pricing import CostTable
from .round import KEY_BUCKET, RoundRunner


@contextmanager
def rehearsal(runner: RoundRunner):
    """Rounds run inside draft every round they can, and what they would teach goes to
    throwaway instances; the runner's own come back afterwards."""
    kept = runner.guard, runner.costs, runner.counters, runner.draft_width
    runner.guard, runner.costs, runner.counters = DraftGuard(), CostTable(), RoundCounters()
    if runner.drafter is not None:
        learned = runner.drafter_records, runner.counted_chances, runner._draft_seconds
        runner.start_learning()
        runner.draft_width = runner.proposals + 1
    try:
        yield
    finally:
        runner.guard, runner.costs, runner.counters, runner.draft_width = kept
        if runner.drafter is not None:
            runner.drafter_records, runner.counted_chances, runner._draft_seconds = learned


def profile(runner: RoundRunner, max_lanes: int, context: int = 64, repeats: int = 2, prompt_chunk: int = 512) -> None:
    """Where shapes are kept steady, run once every shape a round can take for up to
    `max_lanes` lanes (plain and bucketed verify widths with and without taps, lanes on
    the first slots and on others, greedy and sampled proposals, bucketed context
    appends) and the steady prompt chunks (`prompt_shapes`): each is a plan or a
    compiled trace the backend builds on first use. Then
    seed the cost table: target forwards of L lanes x w rows and drafter proposals for L
    lanes, at a short context, best of `repeats`."""
    target, drafter = runner.target, runner.drafter
    counts = sorted({1, min(4, max_lanes), max_lanes})
    widths = [1]
    if drafter is not None and runner.steady_shapes:
        widths = sorted({1} | {runner.verify_width(w) for w in range(2, runner.proposals + 2)})
    elif drafter is not None:
        widths = sorted({1, 2, 4, runner.proposals + 1})
    if runner.steady_shapes:
        _read_every_prompt_shape(runner, max_lanes, prompt_chunk)
    prompt = [1 + (i % (target.vocab_size - 1)) for i in range(context)]
    slots = [target.open_lane() for _ in range(max_lanes)]
    out = target.forward(slots, [prompt] * len(slots), logits="last", taps=runner.taps(drafter is not None))
    target.commit(out, [context] * len(slots))
    drafter_slots = []
    if drafter is not None:
        drafter_slots = [drafter.open_lane() for _ in slots]
        rows = [out.taps[out.row_starts[i] : out.row_starts[i] + context] for i in range(len(slots))]
        drafter.append(drafter_slots, rows, [prompt] * len(slots))
    mx.eval(out.logits, *target.state_arrays(), *(drafter.state_arrays() if drafter else []))

    verify_taps = runner.taps(drafter is not None)

    def forward_only(lanes: int, width: int, taps=verify_taps, first: int = 0) -> list[mx.array]:
        # Shaped as the round that would run it and never committed: the rows it writes
        # past each lane's length are not counted and will be overwritten.
        key_bucket = KEY_BUCKET if width > 1 else runner.plain_key_bucket(lanes)
        forward = target.forward(slots[first : first + lanes], [[1] * width] * lanes, key_bucket=key_bucket, taps=taps)
        return [forward.logits, *target.state_arrays()]

    def propose(lanes: int, pick=None) -> list[mx.array]:
        return drafter.propose(drafter_slots[:lanes], [1] * lanes, runner.proposals, pick, chain_logits=False,
                               confidences=runner.price_live).arrays()

    def variants(lanes: int, width: int):
        """The (taps, first slot) of every round of `lanes` x `width` the engine can run:
        plain rounds tap only when a lane drafts; lanes on slots 0..N-1 and on any other
        slots are different compiled rounds."""
        taps = [verify_taps] if width > 1 or not verify_taps else [(), verify_taps]
        firsts = [0, 1] if lanes < max_lanes else [0]
        return [(t, f) for t in taps for f in firsts]

    sampled = lambda logits, k: mx.argmax(logits, axis=-1)  # a pick: the chain as sampling lanes run it

    def seconds(build) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = runner.clock()
            mx.eval(build())
            best = min(best, runner.clock() - started)
        return best

    try:
        for lanes in range(1, max_lanes + 1) if runner.steady_shapes else ():
            for width in widths:
                for taps, first in variants(lanes, width):
                    mx.eval(forward_only(lanes, width, taps, first))
            if drafter is not None:
                mx.eval(propose(lanes))
                mx.eval(propose(lanes, sampled))
        for lanes in counts:
            for width in widths:
                runner.costs.seed(lanes * width, lanes, context, seconds(lambda: forward_only(lanes, width)))
            if drafter is not None:
                mx.eval(propose(lanes))  # the shapes a first drafted round meets, built now
    finally:
        for slot in slots:
            target.close_lane(slot)
        for slot in drafter_slots:
            drafter.close_lane(slot)
    if drafter is not None and runner.steady_shapes:
        _append_every_bucket(runner, out.taps[:1], max_lanes)


def prompt_shapes(target, max_lanes: int, prompt_chunk: int) -> list[tuple[int, int]]:
    """The (lanes, width) of the steady prompt chunks (`forward(steady=True)`) an engine
    reads most: any number of lanes joining with prompts of up to 64 tokens (a chat
    turn), one lane with any longer chunk."""
    short = sorted({target.chunk_bucket(w) for w in range(1, min(64, prompt_chunk) + 1)})
    long = sorted({target.chunk_bucket(w) for w in range(65, prompt_chunk + 1)})
    return [(lanes, w) for lanes in range(1, max_lanes + 1) for w in short] + [(1, w) for w in long]


def _read_every_prompt_shape(runner: RoundRunner, max_lanes: int, prompt_chunk: int) -> None:
    """Read a prompt chunk of each of `prompt_shapes` into fresh lanes (so its keys span
    what a new prompt's do), with and without the drafter's taps, on the first slots and
    on others (a lane joining takes whichever slot an ended lane left: compiled, another
    trace); never committed."""
    target = runner.target
    slots = [target.open_lane() for _ in range(max_lanes)]
    try:
        previous = None
        for lanes, width in prompt_shapes(target, max_lanes, prompt_chunk):
            if lanes != previous:
                # Every shape's buffers are sizes of its own, which MLX keeps cached until
                # told otherwise: all of them at once outgrew a GPU three warm-ups shared.
                mx.clear_cache()
                previous = lanes
            for taps in {(), runner.taps(runner.drafter is not None)}:
                for first in [0, 1] if lanes < max_lanes else [0]:
                    read = target.forward(slots[first : first + lanes], [[1] * width] * lanes, logits="last", taps=taps, steady=True)
                    mx.eval(read.logits, *([read.taps] if taps else []), *target.state_arrays())
    finally:
        for slot in slots:
            target.close_lane(slot)


def _append_every_bucket(runner: RoundRunner, row: mx.array, max_lanes: int) -> None:
    """Drafter context appends pad their rows to buckets: append each bucket's worth of
    rows once, to a lane opened for it and closed after (every other lane is closed)."""
    drafter = runner.drafter
    most = runner.target.row_bucket(max_lanes * (runner.proposals + 1))
    for rows in (1 << k for k in range(most.bit_length())):
        slot = drafter.open_lane()
        try:
            drafter.append([slot], [mx.repeat(row, rows, axis=0)], [[1] * rows], bucket_rows=True)
            mx.eval(drafter.state_arrays())
        finally:
            drafter.close_lane(slot)

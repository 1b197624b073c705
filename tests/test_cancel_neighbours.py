"""A cancel that lands while a pipelined plain round is in flight changes nothing for the
cancelled lane's neighbours.

A pipelined plain round is dispatched before the round before it is read back, so when a
cancel arrives at the round boundary the round in flight still holds the cancelled
lane's row, between its neighbours' rows. Landing it must skip that row and give every
other lane its own: the neighbours' replies equal their solo runs token for token
(found missing by `python -m bench.mutants`: a neighbour paired with the wrong row
passed every cancellation test, which cancelled during drafted rounds).
"""

from __future__ import annotations

import numpy as np
import pytest

from families.lfm2 import open_target
from lanes.engine import Engine, EngineConfig
from lanes.lane import FinishReason, Request
from lanes.sampling import SamplingParams

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(700 + i).integers(15, 500, 5 + 3 * i)] for i in range(5)]
MAX_TOKENS = 24
SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(repetition_penalty=1.2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=2),
    SamplingParams(temperature=0.5, min_p=0.05, repetition_penalty=1.2, seed=3),
]


def plain_engine(path, lanes: int) -> Engine:
    loaded = open_target(path, max_lanes=lanes)
    return Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, config=EngineConfig(max_streams=lanes))


def request(i: int, **kwargs) -> Request:
    return Request(PROMPTS[i], MAX_TOKENS, SETTINGS[i], **kwargs)


@pytest.fixture(scope="module")
def solo(dense_dir):
    return [plain_engine(dense_dir, 1).generate([request(i)])[0].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("cancelled", [(1,), (0, 2), (3,)])
def test_neighbours_of_a_lane_cancelled_under_a_pipelined_round_equal_their_solo_runs(cancelled, dense_dir, solo):
    engine = plain_engine(dense_dir, len(PROMPTS))
    landed_with_cancelled = []
    land = engine.rounds._land

    def recording_land(dispatch):
        landed_with_cancelled.append(any(lane.finish_reason is FinishReason.CANCELLED for lane in dispatch.lanes))
        return land(dispatch)

    engine.rounds._land = recording_land
    finished = {}
    requests = [request(i, on_event=lambda e: e.completion and finished.setdefault(e.request_id, e.completion))
                for i in range(len(PROMPTS))]
    for r in requests:
        engine.submit(r)
    # Every lane decoding, and a pipelined plain round in flight, fed the round before's choices.
    while not (engine.running == len(PROMPTS) and engine.prefilling == 0
               and engine.rounds._inflight is not None and engine.rounds._inflight.pipelined):
        engine.step()
    assert not finished, "a lane ended before the cancel: the test needs all of them decoding"
    for i in cancelled:
        engine.cancel(requests[i].id)
    engine.run_until_idle()

    assert any(landed_with_cancelled), "no round in flight held a cancelled lane's row"
    for i, r in enumerate(requests):
        done = finished[r.id]
        if i in cancelled:
            assert done.finish_reason is FinishReason.CANCELLED
            assert 0 < len(done.token_ids) < len(solo[i]) and done.token_ids == solo[i][: len(done.token_ids)]
        else:
            assert done.token_ids == solo[i], f"lane {i}, a neighbour of the cancelled {cancelled}"

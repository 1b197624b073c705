"""bench.soak: its exactness check catches a reply that departs from an earlier one, and a
short soak of overlapped drafted rounds on a tiny model comes out clean."""

from __future__ import annotations

import json

from bench.soak import Replies, main
from lanes.lane import Request
from lanes.sampling import SamplingParams


def test_replies_accept_prefixes_and_catch_a_departure():
    replies = Replies()
    greedy = Request([1, 5, 9], 8)
    replies.check(greedy, [4, 4, 7])
    replies.check(greedy, [4, 4])  # shorter: a prefix
    replies.check(greedy, [4, 4, 7, 2, 3])  # longer: continues it
    replies.check(Request([1, 5, 9], 8, SamplingParams(temperature=0.7, seed=1)), [6, 6])  # other sampling: its own key
    assert replies.mismatches == [] and replies.compared == 2
    replies.check(greedy, [4, 4, 7, 9])
    assert len(replies.mismatches) == 1 and replies.mismatches[0]["before"] == [4, 4, 7, 2, 3]


def test_short_soak_of_overlapped_rounds_is_clean(dense_dir, drafter_dir, tmp_path):
    out = tmp_path / "soak.json"
    status = main(["--model", str(dense_dir), "--draft-model", str(drafter_dir), "--requests", "120", "--concurrency", "12",
                   "--max-streams", "8", "--overlap", "on", "--always-draft", "--out", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report
    assert report["errors"] == 0 and report["mismatches"] == 0 and report["replies_compared"] >= 10
    assert report["rounds_by_mode"]["drafted"] >= 20

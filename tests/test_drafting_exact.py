"""Drafting changes speed, never tokens: drafted output equals plain output token for
token (greedy), and the sampled path is lossless in distribution.

Random tiny drafters are rejected almost always, which would leave partial accepts
untested; so most runs here wrap the real drafter in the scripted-acceptance drafter:
it pays the real forward, then proposes the target's own continuation with the
published survival profile, so rounds accept 0..width drafts and every commit/rollback
path runs. The target verifies every draft either way.
"""

from __future__ import annotations

import numpy as np
import pytest

from daemon.cli import main
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams
from bench.scripted import ScriptedDrafter, published_profile
from tests.priced import price_without_timing

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(i).integers(15, 500, 4 + 5 * i)] for i in range(8)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def drafter_dir(dense_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("drafter"), dense_dir, seed=5, block_size=9)


@pytest.fixture(scope="module")
def moe_drafter_dir(moe_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("moe_drafter"), moe_dir, seed=6, block_size=9)


def engine_for(path, drafter_dir=None, sequences=None, width=None, lanes=16, bits=None, steady_shapes=False):
    loaded = open_target(path, max_lanes=lanes)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, bits=bits, max_lanes=lanes)
        if sequences is not None:
            drafter = ScriptedDrafter(drafter, sequences, published_profile(), loaded.target.vocab_size)
    config = EngineConfig(max_streams=lanes, draft_width=width, steady_shapes=steady_shapes)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, config)
    if drafter is not None and width is None:
        engine.warm_up()
    return engine


def plain_runs(path, prompts, max_tokens=MAX_TOKENS):
    return [c.token_ids for c in engine_for(path).generate([Request(p, max_tokens) for p in prompts])]


@pytest.fixture(scope="module")
def plain(dense_dir):
    return plain_runs(dense_dir, PROMPTS)


def sequences_of(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs)]


@pytest.mark.parametrize("width", range(2, 11))
def test_greedy_drafted_equals_plain_at_every_width(width, dense_dir, drafter_dir, plain):
    scripted = sequences_of(PROMPTS, plain)
    # Batch 1: each prompt alone.
    for prompt, expected in zip(PROMPTS, plain):
        (done,) = engine_for(dense_dir, drafter_dir, scripted, width, lanes=1).generate([Request(prompt, MAX_TOKENS)])
        assert done.token_ids == expected
        assert done.draft.drafted_rounds > 0
    # 4 lanes, two of them plain by request.
    engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=4)
    done = engine.generate([Request(p, MAX_TOKENS, draft=i % 2 == 0) for i, p in enumerate(PROMPTS[:4])])
    assert [d.token_ids for d in done] == plain[:4]
    assert done[1].draft.drafted_rounds == 0 and done[0].draft.accepted > 0


def test_sixteen_lanes_mixing_drafted_and_plain(dense_dir, drafter_dir, plain):
    prompts = PROMPTS + [p[:-1] for p in PROMPTS]  # 16 distinct prompts
    expected = plain + plain_runs(dense_dir, prompts[8:])
    scripted = sequences_of(prompts, expected)
    for width in (4, 10, None):  # fixed widths and priced windows with guards
        engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=16)
        done = engine.generate([Request(p, MAX_TOKENS, draft=i % 3 != 0) for i, p in enumerate(prompts)])
        assert [d.token_ids for d in done] == expected, f"width {width}"
        if width is not None:  # priced windows draft where measured costs say so: machine-dependent
            assert sum(d.draft.accepted for d in done) > 0


def test_rounds_padded_to_steady_shapes_stay_exact(dense_dir, drafter_dir, plain):
    # What a CUDA backend runs: every lane of a drafted round feeds one bucketed width,
    # several plain lanes attend a bucketed key span, drafter appends pad their rows.
    scripted = sequences_of(PROMPTS, plain)
    for width in (3, 10, None):
        engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=4, steady_shapes=True)
        if width is None:
            price_without_timing(engine)
        done = engine.generate([Request(p, MAX_TOKENS, draft=i % 2 == 0) for i, p in enumerate(PROMPTS[:4])])
        assert [d.token_ids for d in done] == plain[:4], f"width {width}"
        assert done[0].draft.accepted > 0 and done[1].draft.drafted_rounds == 0


def test_unscripted_drafter_is_exact_too(dense_dir, drafter_dir, plain, moe_dir, moe_drafter_dir):
    """The real (random) drafter's own proposals, mostly rejected: rollback at accept 0."""
    for width in (10, None):
        done = engine_for(dense_dir, drafter_dir, None, width, lanes=8).generate([Request(p, MAX_TOKENS) for p in PROMPTS])
        assert [d.token_ids for d in done] == plain
    moe_plain = plain_runs(moe_dir, PROMPTS[:4], 24)
    engine = engine_for(moe_dir, moe_drafter_dir, sequences_of(PROMPTS[:4], moe_plain), 6, lanes=4)
    assert [d.token_ids for d in engine.generate([Request(p, 24) for p in PROMPTS[:4]])] == moe_plain


def test_eight_bit_drafter_stays_exact(dense_dir, drafter_dir, plain):
    done = engine_for(dense_dir, drafter_dir, None, 5, lanes=8, bits=8).generate([Request(p, MAX_TOKENS) for p in PROMPTS])
    assert [d.token_ids for d in done] == plain


class PoisonedDrafter(ScriptedDrafter):
    """Feeds NaN taps into one slot's context, so that lane's drafts come back non-finite."""

    def __init__(self, *args, poisoned_slot: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned_slot = poisoned_slot

    def append(self, lanes, taps, tokens, bucket_rows=False):
        taps = [t * float("nan") if lane.slot == self.poisoned_slot else t for lane, t in zip(lanes, taps)]
        super().append(lanes, taps, tokens, bucket_rows)


def test_a_faulty_lane_runs_plain_and_its_neighbours_keep_drafting(dense_dir, drafter_dir, plain):
    loaded = open_target(dense_dir, max_lanes=4)
    real = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, max_lanes=4)
    poisoned = PoisonedDrafter(real, sequences_of(PROMPTS, plain), published_profile(), loaded.target.vocab_size, poisoned_slot=1)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, poisoned, EngineConfig(max_streams=4, draft_width=6))
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    assert done[1].draft.errors and "NaN or Inf" in done[1].draft.errors[0] and done[1].draft.accepted == 0
    assert not done[0].draft.errors and done[0].draft.accepted > 0


# ---- sampling ------------------------------------------------------------------------------

SAMPLED_PROMPT = [1, 40, 41, 42, 43, 44]
SAMPLING = dict(temperature=4.0, top_p=0.98, min_p=0.01)
RUNS = 1200
POSITIONS = 4


@pytest.fixture(scope="module")
def sampled_pair(tmp_path_factory):
    """A tiny target and drafter whose filtered distributions overlap enough that drafts
    are accepted often and rejected often."""
    target = make_tiny_target(tmp_path_factory.mktemp("t_sampled"), "lfm2", seed=11, shape=TinyShape(vocab=300, hidden=32, layers=3))
    drafter = make_tiny_drafter(tmp_path_factory.mktemp("d_sampled"), target, seed=12, block_size=4)
    return target, drafter


def sampled_outputs(target, drafter, width, runs=RUNS, accept_everything=False, monkeypatch=None):
    engine = engine_for(target, drafter, None, width, lanes=16)
    if accept_everything:
        monkeypatch.setattr("lanes.verify.rejection_accept_length", lambda p, q, u: len(p))
    requests = [Request(SAMPLED_PROMPT, POSITIONS, SamplingParams(seed=seed, **SAMPLING)) for seed in range(runs)]
    done = []
    for start in range(0, runs, 64):
        done += engine.generate(requests[start : start + 64])
    # A run that stopped early (an eos id) shows -1 after its end: stopping is part of the distribution.
    return np.array([d.token_ids + [-1] * (POSITIONS - len(d.token_ids)) for d in done]), done


def two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    values = np.union1d(a, b)
    counts = np.array([[np.sum(a == v), np.sum(b == v)] for v in values], dtype=float)
    keep = counts.sum(axis=1) >= 10  # pool rare categories so the statistic is valid
    counts = np.vstack([counts[keep], counts[~keep].sum(axis=0, keepdims=True)]) if (~keep).any() else counts[keep]
    counts = counts[counts.sum(axis=1) > 0]
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The p = 0.001 critical value of chi-square on `df` degrees of freedom
    (Wilson-Hilferty; within 1% of the exact value from df = 3 up). A correct sampler
    fails a position with probability 1e-3; outputs are seeded, so a pass stays a pass."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_drafting_is_lossless(sampled_pair, monkeypatch):
    target, drafter = sampled_pair
    plain, _ = sampled_outputs(target, None, None)
    drafted, done = sampled_outputs(target, drafter, 4)
    proposed = sum(d.draft.proposed for d in done)
    accepted = sum(d.draft.accepted for d in done)
    assert 0.15 < accepted / proposed < 0.9, "the test needs both accepts and rejections"
    for position in range(1, POSITIONS):  # position 0 comes from prefill, before any draft
        statistic, df = two_sample_chi_square(plain[:, position], drafted[:, position])
        assert statistic < chi_square_critical(df), f"position {position}: chi2 {statistic:.1f} on {df} df"
    # The same statistic catches a biased verifier that accepts every draft.
    biased, _ = sampled_outputs(target, drafter, 4, accept_everything=True, monkeypatch=monkeypatch)
    worst = max(two_sample_chi_square(plain[:, k], biased[:, k]) for k in range(1, POSITIONS))
    assert worst[0] > chi_square_critical(worst[1])


def test_seeded_sampling_ignores_its_neighbours(sampled_pair):
    """At a fixed width a lane's draws depend on its own seed and positions only."""
    target, drafter = sampled_pair
    request = lambda seed, prompt=SAMPLED_PROMPT: Request(prompt, 12, SamplingParams(seed=seed, **SAMPLING))
    (alone,) = engine_for(target, drafter, None, 4, lanes=1).generate([request(7)])
    crowd = engine_for(target, drafter, None, 4, lanes=4).generate([request(1, [1, 50, 51]), request(7), request(3), request(9, [1, 60])])
    assert crowd[1].token_ids == alone.token_ids


# ---- the command line ----------------------------------------------------------------------


def test_generate_reports_drafting(dense_dir, drafter_dir, capsys):
    import json

    args = ["generate", "--model", str(dense_dir), "--prompt-ids", ",".join(map(str, PROMPTS[3])), "--max-tokens", "20", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--draft-width", "4"], [], ["--drafter-bits", "8", "--draft-width", "10"]):
        assert main(args + ["--draft-model", str(drafter_dir)] + extra) == 0
        drafted = json.loads(capsys.readouterr().out)
        assert drafted["token_ids"] == plain["token_ids"]
        assert set(drafted["draft"]) >= {"rounds", "proposed", "accepted", "accepted_per_round"}
    assert main(args + ["--draft-model", str(drafter_dir), "--no-draft"]) == 0
    assert json.loads(capsys.readouterr().out)["draft"]["proposed"] == 0


@pytest.mark.parametrize("extra,message", [
    (["--drafter-bits", "4"], "drafter bits 4 is not supported"),
    (["--draft-width", "11"], "--draft-width must be within 2..10"),
])
def test_generate_refuses_bad_drafting_flags(extra, message, dense_dir, drafter_dir, capsys):
    args = ["generate", "--model", str(dense_dir), "--prompt", "hi", "--max-tokens", "4", "--draft-model", str(drafter_dir)]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_mismatched_pairing_is_refused_at_startup(drafter_dir, tmp_path, capsys):
    deeper = make_tiny_target(tmp_path, "lfm2", seed=1, shape=TinyShape(layers=8))
    assert main(["generate", "--model", str(deeper), "--prompt", "hi", "--draft-model", str(drafter_dir)]) == 2
    err = capsys.readouterr().err
    assert "laneserve: error:" in err and "num_target_layers" in err and "Traceback" not in err

"""Drafting changes speed, never tokens: drafted output equals plain output token for
token (greedy), and the sampled path is lossless in distribution.

Random tiny drafters are rejected almost always, which would leave partial accepts
untested; so most runs here wrap the real drafter in the scripted-acceptance drafter:
it pays the real forward, then proposes the target's own continuation with the
published survival profile, so rounds accept 0..width drafts and every commit/rollback
path runs. The target verifies every draft either way.
"""

from __future__ import annotations

import collections
import dataclasses
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bench.scripted import ScriptedDrafter, published_profile
from daemon.cli import main
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams, filtered_logprobs
from tests.priced import (
    assert_drafted,
    fewest_drafted_rounds,
    price_without_timing,
    tiny_engine,
)

PROMPTS = [[1] + [int(t) for t in np.random.default_rng(i).integers(15, 500, 4 + 5 * i)] for i in range(8)]
MAX_TOKENS = 40
PRICED_WIDTH = 10  # the widest window priced rounds verify: the anchor and the drafter's block of 9


def engine_for(path, drafter_dir=None, sequences=None, width=None, lanes=16, bits=None, steady_shapes=False, price_live=None):
    # Priced windows, drafted every round on any machine, where no width is fixed.
    return tiny_engine(path, drafter_dir, lanes, sequences, bits, draft_width=width, steady_shapes=steady_shapes,
                       price_live=price_live)


def plain_runs(path, prompts, max_tokens=MAX_TOKENS):
    return [c.token_ids for c in engine_for(path).generate([Request(p, max_tokens) for p in prompts])]


@pytest.fixture(scope="module")
def plain(dense_dir):
    return plain_runs(dense_dir, PROMPTS)


def sequences_of(prompts, outputs):
    return [p + o for p, o in zip(prompts, outputs)]


def scripted_floors(outputs, width):
    """Floors on (drafted rounds, accepted drafts) for scripted lanes that wrote `outputs`
    drafting every round at `width` rows: the rounds they cannot have done without, and
    half as many accepts, since the published profile keeps a round's first draft 86.5%
    of the time."""
    rounds = fewest_drafted_rounds(outputs, width)
    return rounds, rounds // 2


@pytest.mark.parametrize("width", range(2, 11))
def test_greedy_drafted_equals_plain_at_every_width(width, dense_dir, drafter_dir, plain):
    scripted = sequences_of(PROMPTS, plain)
    # Batch 1: each prompt alone.
    for prompt, expected in zip(PROMPTS, plain):
        (done,) = engine_for(dense_dir, drafter_dir, scripted, width, lanes=1).generate([Request(prompt, MAX_TOKENS)])
        assert done.token_ids == expected
        assert_drafted([done], *scripted_floors([expected], width))
    # 4 lanes, two of them plain by request.
    engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=4)
    done = engine.generate([Request(p, MAX_TOKENS, draft=i % 2 == 0) for i, p in enumerate(PROMPTS[:4])])
    assert [d.token_ids for d in done] == plain[:4]
    assert done[1].draft.drafted_rounds == done[3].draft.drafted_rounds == 0
    assert_drafted(done[::2], *scripted_floors(plain[:4:2], width))


def test_sixteen_lanes_mixing_drafted_and_plain(dense_dir, drafter_dir, plain):
    prompts = PROMPTS + [p[:-1] for p in PROMPTS]  # 16 distinct prompts
    expected = plain + plain_runs(dense_dir, prompts[8:])
    scripted = sequences_of(prompts, expected)
    drafting = [i % 3 != 0 for i in range(len(prompts))]
    for width in (4, 10, None):  # fixed widths and priced windows
        engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=16)
        done = engine.generate([Request(p, MAX_TOKENS, draft=d) for p, d in zip(prompts, drafting)])
        assert [d.token_ids for d in done] == expected, f"width {width}"
        assert_drafted([d for d, on in zip(done, drafting) if on],
                       *scripted_floors([e for e, on in zip(expected, drafting) if on], width or PRICED_WIDTH))


def test_rounds_padded_to_steady_shapes_stay_exact(dense_dir, drafter_dir, plain):
    # What a CUDA backend runs: every lane of a drafted round feeds one bucketed width,
    # several plain lanes attend a bucketed key span, drafter appends pad their rows.
    scripted = sequences_of(PROMPTS, plain)
    for width in (3, 10, None):
        engine = engine_for(dense_dir, drafter_dir, scripted, width, lanes=4, steady_shapes=True)
        done = engine.generate([Request(p, MAX_TOKENS, draft=i % 2 == 0) for i, p in enumerate(PROMPTS[:4])])
        assert [d.token_ids for d in done] == plain[:4], f"width {width}"
        assert done[1].draft.drafted_rounds == done[3].draft.drafted_rounds == 0
        assert_drafted(done[::2], *scripted_floors(plain[:4:2], width or PRICED_WIDTH))


def test_unscripted_drafter_is_exact_too(dense_dir, drafter_dir, plain, moe_dir, moe_drafter_dir):
    """The real (random) drafter's own proposals, mostly rejected: rollback at accept 0."""
    for width in (10, None):
        done = engine_for(dense_dir, drafter_dir, None, width, lanes=8).generate([Request(p, MAX_TOKENS) for p in PROMPTS])
        assert [d.token_ids for d in done] == plain
        # What this needs is rollback at accept 0: random drafts are nearly always rejected
        # (4 of some 2700 kept here), so no floor on accepts, but every round must draft.
        assert_drafted(done, fewest_drafted_rounds(plain, width or PRICED_WIDTH), 0)
    moe_plain = plain_runs(moe_dir, PROMPTS[:4], 24)
    engine = engine_for(moe_dir, moe_drafter_dir, sequences_of(PROMPTS[:4], moe_plain), 6, lanes=4)
    done = engine.generate([Request(p, 24) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == moe_plain
    assert_drafted(done, *scripted_floors(moe_plain, 6))


def test_eight_bit_drafter_stays_exact(dense_dir, drafter_dir, plain):
    done = engine_for(dense_dir, drafter_dir, None, 5, lanes=8, bits=8).generate([Request(p, MAX_TOKENS) for p in PROMPTS])
    assert [d.token_ids for d in done] == plain
    assert_drafted(done, fewest_drafted_rounds(plain, 5), 0)  # random drafts: see above


class PoisonedDrafter(ScriptedDrafter):
    """Feeds NaN taps into one slot's context, so that lane's drafts come back non-finite."""

    def __init__(self, *args, poisoned_slot: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned_slot = poisoned_slot

    def append(self, lanes, taps, tokens, bucket_rows=False):
        if isinstance(taps, mx.array):  # every lane's rows in one array: poison the lane's own
            owner = mx.array([lane.slot for lane, ids in zip(lanes, tokens) for _ in ids])
            taps = mx.where((owner == self.poisoned_slot)[:, None], float("nan"), taps)
        else:
            taps = [t * float("nan") if lane.slot == self.poisoned_slot else t for lane, t in zip(lanes, taps)]
        super().append(lanes, taps, tokens, bucket_rows)


@pytest.mark.parametrize("config", [dict(draft_width=6), dict(price_live=True), dict(price_live=False)],
                         ids=["fixed", "priced-live", "priced-ahead"])
def test_a_faulty_lane_runs_plain_and_its_neighbours_keep_drafting(config, dense_dir, drafter_dir, plain):
    # Read before the verify (priced live), the faulty lane verifies no drafts; verified
    # unread (fixed, priced ahead), its drafts are fed clipped and none is kept.
    loaded = open_target(dense_dir, max_lanes=4)
    real = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, max_lanes=4)
    poisoned = PoisonedDrafter(real, sequences_of(PROMPTS, plain), published_profile(), loaded.target.vocab_size, poisoned_slot=1)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, poisoned, EngineConfig(max_streams=4, **config))
    if "draft_width" not in config:
        price_without_timing(engine)
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    assert done[1].draft.errors and "NaN or Inf" in done[1].draft.errors[0] and done[1].draft.accepted == 0
    assert done[1].draft.drafted_rounds == 0
    healthy = [done[0], *done[2:]]
    assert not any(d.draft.errors for d in healthy)
    assert_drafted(healthy, *scripted_floors([plain[0], *plain[2:4]], config.get("draft_width", PRICED_WIDTH)))


@pytest.mark.parametrize("steady_shapes", [False, True], ids=["exact-shapes", "steady-shapes"])
@pytest.mark.parametrize("params", [dict(), dict(temperature=0.7, top_p=0.95, repetition_penalty=1.2)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("lanes", [1, 16])
def test_priced_ahead_of_the_proposal_drafted_equals_plain(steady_shapes, params, lanes, dense_dir, drafter_dir):
    # Windows priced by counted chances, the drafter's proposal fed to the verify on the
    # device and read with it: the round's one host sync.
    prompts = [PROMPTS[i % len(PROMPTS)] + [40 + i] for i in range(lanes)]
    request = lambda i, p: Request(p, MAX_TOKENS, SamplingParams(seed=70 + i, **params), draft=i % 5 != 3)
    plain = engine_for(dense_dir, lanes=lanes).generate([request(i, p) for i, p in enumerate(prompts)])
    engine = engine_for(dense_dir, drafter_dir, [p + d.token_ids for p, d in zip(prompts, plain)], None, lanes=lanes,
                        steady_shapes=steady_shapes, price_live=False)
    drafted = engine.generate([request(i, p) for i, p in enumerate(prompts)])
    assert [d.token_ids for d in drafted] == [d.token_ids for d in plain]
    on = [i % 5 != 3 for i in range(lanes)]
    assert_drafted([d for d, o in zip(drafted, on) if o], *scripted_floors([d.token_ids for d, o in zip(plain, on) if o], PRICED_WIDTH))


class CountingEvals:
    """mlx.core as lanes.round sees it, counting `eval` calls (host syncs; `async_eval`
    launches without waiting)."""

    def __init__(self):
        self.evals = 0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *arrays):
        self.evals += 1
        return mx.eval(*arrays)


@pytest.mark.parametrize("config, syncs", [(dict(draft_width=6), 1), (dict(price_live=False), 1), (dict(price_live=True), 2)],
                         ids=["fixed", "priced-ahead", "priced-live"])
def test_a_drafted_round_reads_the_device_once_unless_priced_live(config, syncs, dense_dir, drafter_dir, plain, monkeypatch):
    import lanes.round

    engine = tiny_engine(dense_dir, drafter_dir, 4, sequences_of(PROMPTS, plain), **config)
    counting = CountingEvals()
    monkeypatch.setattr(lanes.round, "mx", counting)
    per_round = []
    drafted_round = engine.rounds._drafted_round

    def counted(*args):
        before = counting.evals
        result = drafted_round(*args)
        per_round.append(counting.evals - before)
        return result

    engine.rounds._drafted_round = counted
    done = engine.generate([Request(p, MAX_TOKENS) for p in PROMPTS[:4]])
    assert [d.token_ids for d in done] == plain[:4]
    assert len(per_round) >= 8 and set(per_round) == {syncs}


# ---- sampling ------------------------------------------------------------------------------
#
# A sampled token is the seeded Gumbel-max draw at its position, and a draft is kept exactly
# when it equals that draw: drafted output equals plain output token for token at every
# temperature, and the output law is the target's filtered distribution.

SAMPLED_PROMPT = [1, 40, 41, 42, 43, 44]
SAMPLING = dict(temperature=4.0, top_p=0.98, min_p=0.01)


@pytest.fixture(scope="module")
def sampled_pair(tmp_path_factory):
    """A tiny target and drafter whose filtered distributions overlap, so that the real
    drafter's coupled proposals are accepted often and rejected often."""
    target = make_tiny_target(tmp_path_factory.mktemp("t_sampled"), "lfm2", seed=11, shape=TinyShape(vocab=300, hidden=32, layers=3))
    drafter = make_tiny_drafter(tmp_path_factory.mktemp("d_sampled"), target, seed=12, block_size=4)
    return target, drafter


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("width,lanes", [(2, 1), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4), (8, 4), (9, 16), (10, 4), (None, 16), (None, 1)])
def test_seeded_sampling_drafted_equals_plain(temperature, width, lanes, dense_dir, drafter_dir):
    params = lambda i: SamplingParams(temperature=temperature, top_p=0.95, seed=1000 + i)
    prompts = PROMPTS[:lanes] if lanes <= len(PROMPTS) else [PROMPTS[i % len(PROMPTS)] + [20 + i] for i in range(lanes)]
    stops = lambda i: ("ab",) if i % 3 == 1 else ()
    plain = engine_for(dense_dir, lanes=lanes).generate([Request(p, MAX_TOKENS, params(i), stops(i)) for i, p in enumerate(prompts)])
    drafter = engine_for(dense_dir, drafter_dir, [p + d.token_ids for p, d in zip(prompts, plain)], width, lanes=lanes)
    drafted = drafter.generate([Request(p, MAX_TOKENS, params(i), stops(i)) for i, p in enumerate(prompts)])
    assert [d.token_ids for d in drafted] == [d.token_ids for d in plain]
    assert [d.text for d in drafted] == [d.text for d in plain]
    assert_drafted(drafted, *scripted_floors([d.token_ids for d in plain], width or PRICED_WIDTH))


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.2),  # greedy with a penalty
    dict(temperature=0.3, min_p=0.05, repetition_penalty=1.2),  # the embedded default's settings
    dict(top_k=2),  # greedy: top-k leaves the argmax alone, on both paths
    dict(temperature=1.5, top_k=2),
    dict(temperature=1.5, top_k=2, repetition_penalty=1.3),
])
@pytest.mark.parametrize("width,lanes", [(3, 1), (9, 4), (None, 16)])
def test_top_k_and_repetition_penalty_drafted_equal_plain(params, width, lanes, dense_dir, drafter_dir):
    # A verify row draws from the target's top-k, and a penalised row sees the lane's
    # history and the drafts before it: every verify row must filter and penalise exactly
    # what the plain step at that position would.
    prompts = [PROMPTS[i % len(PROMPTS)] + [30 + i] for i in range(lanes)]
    request = lambda i, p, settings: Request(p, MAX_TOKENS, SamplingParams(seed=50 + i, **settings))
    plain = engine_for(dense_dir, lanes=lanes).generate([request(i, p, params) for i, p in enumerate(prompts)])
    drafter = engine_for(dense_dir, drafter_dir, [p + d.token_ids for p, d in zip(prompts, plain)], width, lanes=lanes)
    drafted = drafter.generate([request(i, p, params) for i, p in enumerate(prompts)])
    assert [d.token_ids for d in drafted] == [d.token_ids for d in plain]
    assert_drafted(drafted, *scripted_floors([d.token_ids for d in plain], width or PRICED_WIDTH))
    if params != dict(top_k=2):  # the settings are in play: without them the replies differ
        unset = {k: v for k, v in params.items() if k not in ("top_k", "repetition_penalty")}
        bare = engine_for(dense_dir, lanes=lanes).generate([request(i, p, unset) for i, p in enumerate(prompts)])
        assert [b.token_ids for b in bare] != [d.token_ids for d in plain]


def test_coupled_proposals_are_accepted_and_exact(sampled_pair):
    """The real drafter proposes with the target's noise at each position: its sampled
    drafts are kept where it agrees with the target's own draw, and only there."""
    target, drafter = sampled_pair
    requests = lambda: [Request(SAMPLED_PROMPT, 24, SamplingParams(seed=seed, **SAMPLING)) for seed in range(16)]
    plain = engine_for(target, lanes=16).generate(requests())
    drafted = engine_for(target, drafter, None, 4, lanes=16).generate(requests())
    assert [d.token_ids for d in drafted] == [d.token_ids for d in plain]
    assert_drafted(drafted, fewest_drafted_rounds([d.token_ids for d in plain], 4), 1)  # accepts: the ratio below
    proposed = sum(d.draft.proposed for d in drafted)
    accepted = sum(d.draft.accepted for d in drafted)
    assert 0.1 < accepted / proposed < 0.95, "the test needs both accepts and rejections"


def test_seeded_first_tokens_follow_the_target_distribution(sampled_pair):
    """Over many seeds, the engine's sampled token follows the target's filtered
    distribution (chi-square against p computed from the target's own logits)."""
    target, _ = sampled_pair
    engine = engine_for(target, lanes=16)
    loaded = open_target(target, max_lanes=1)
    logits, _ = loaded.target.prefill(loaded.target.open_lane(), SAMPLED_PROMPT)
    params = SamplingParams(**SAMPLING)
    p = np.exp(np.array(filtered_logprobs(logits[None].astype(mx.float32), [params]))[0])
    runs = 2000
    firsts = []
    for start in range(0, runs, 64):
        batch = [Request(SAMPLED_PROMPT, 1, SamplingParams(seed=s, **SAMPLING)) for s in range(start, min(start + 64, runs))]
        firsts += [d.token_ids[0] if d.token_ids else -1 for d in engine.generate(batch)]
    counts = np.bincount([t for t in firsts if t >= 0], minlength=len(p)).astype(float)
    counts[list(loaded.eos_ids)] += firsts.count(-1)
    assert counts[p == 0].sum() == 0
    expected = p * runs
    pooled = expected < 10  # pool rare categories so the statistic is valid
    observed = np.append(counts[~pooled], counts[pooled].sum())
    wanted = np.append(expected[~pooled], expected[pooled].sum())
    statistic = float(((observed - wanted) ** 2 / np.maximum(wanted, 1e-12)).sum())
    assert statistic < chi_square_critical(len(observed) - 1), statistic


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The p = 0.001 critical value of chi-square on `df` degrees of freedom
    (Wilson-Hilferty; within 1% of the exact value from df = 3 up). Outputs are seeded,
    so a pass stays a pass."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


# ---- the law of drafted sampling after a rejection -------------------------------------------
#
# A kept draft equals the target's own draw, so the emitted law is the target's only if a
# rejected row emits the target's coupled draw and nothing past it is kept. Here LAW_SEEDS
# replies of three tokens go through real drafted rounds (width 2: t1 from the prompt, t2
# from the row that verifies one draft, t3 after), at temperature 1 with top_k 3, and their
# joint counts meet the target's exact law in a chi-square test (replies expected fewer
# than 10 times pooled; 12 degrees of freedom; critical value 33.07, p = 0.001).
#
# Power, from the analytic laws: p from the target, q = p^4 normalised from surer_drafter,
# and for shared Gumbel noise the chance that both draws are s, A(s) = 1 / (1 + sum over
# j != s of max(p_j / p_s, q_j / q_s)) (sum of A: 0.70, 0.68, 0.61 for the three t1).
# - A rejected row that emits a fresh draw from p (a new key) instead of the coupled one:
#   t2 then has law A(s) + (1 - sum A) p(s), which overweights the target's likeliest
#   token (the drafter's favourite, kept whenever both draw it). Non-centrality
#   lambda = N sum (p_mutant - p)^2 / p = 69.4 at N = 1000: power 0.9996 (non-central
#   chi-square, 12 df). Applied to lanes/verify.py: statistic 96.2.
# - A verifier that keeps one draft too many (accepted + 1 after a rejection): emitting the
#   rejected draft makes t2 follow q, lambda = 348, power 1 - 1e-13 (applied: 345.5);
#   emitting the target's choices but committing the row after the rejected draft draws t3
#   as if the draft had been kept, and 30% of replies are ones the target cannot sample
#   (applied: the support check fails). Both also break test_seeded_sampling_drafted_equals_plain.
# Unmutated, the statistic is 16.7; the seeds are fixed, so a pass stays a pass.

LAW_PROMPT = SAMPLED_PROMPT
LAW = SamplingParams(temperature=1.0, top_k=3)  # three tokens a position: few categories
LAW_SEEDS = 1000
SURENESS = 4  # the drafter's logits are the target's times this: q is proportional to p^4


def last_logits(target, tokens: list[int]) -> np.ndarray:
    lane = target.open_lane()
    logits, _ = target.prefill(lane, tokens)
    target.close_lane(lane)
    return np.array(logits)


def filtered_p(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return np.exp(np.array(filtered_logprobs(mx.array(logits)[None], [params]))[0])


def reply_law(target, prompt: list[int], params: SamplingParams, length: int, eos_ids) -> dict[tuple[int, ...], float]:
    """The exact law of a sampled reply of `length` tokens, from the target's own filtered
    distributions (a reply that meets an eos id is the tokens before it)."""
    law: dict[tuple[int, ...], float] = {}

    def extend(reply: list[int], chance: float) -> None:
        if len(reply) == length:
            law[tuple(reply)] = chance
            return
        p = filtered_p(last_logits(target, prompt + reply), params)
        for token in map(int, np.flatnonzero(p)):
            if token in eos_ids:
                law[tuple(reply)] = law.get(tuple(reply), 0.0) + chance * p[token]
            else:
                extend(reply + [token], chance * p[token])

    extend([], 1.0)
    return law


@pytest.fixture(scope="module")
def surer_drafter(sampled_pair, tmp_path_factory):
    """The sampled pair's drafter rewired so that its first proposal after LAW_PROMPT + t1
    comes from the target's own logits there, times SURENESS: its final norm is zeroed,
    so the Markov head alone makes the chain logits, and the head maps each first token
    the target may sample to the target's logits after it. A drafter surer than the
    target, as drafters are: its coupled draw agrees with the target's about 70% of the
    time, and where they disagree is far from uniform."""
    target_dir, drafter_dir = sampled_pair
    target = open_target(target_dir, max_lanes=1).target
    out = tmp_path_factory.mktemp("surer") / "drafter"
    shutil.copytree(drafter_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors["norm.weight"][:] = 0
    w1, w2 = tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"]
    w1[:], w2[:] = 0, 0
    for i, first in enumerate(map(int, np.flatnonzero(filtered_p(last_logits(target, LAW_PROMPT), LAW)))):
        w1[first, i] = 1
        w2[:, i] = SURENESS * last_logits(target, LAW_PROMPT + [first])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_drafted_replies_follow_the_target_law_where_drafts_are_rejected(sampled_pair, surer_drafter):
    target_dir, _ = sampled_pair
    loaded = open_target(target_dir, max_lanes=16)
    drafter = load_drafter(surer_drafter, loaded.target.model, loaded.target.config, max_lanes=16)
    # Width 2: the first round after the prompt verifies one draft against t2.
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=16, draft_width=2))
    done = []
    for start in range(0, LAW_SEEDS, 64):
        seeds = range(start, min(start + 64, LAW_SEEDS))
        done += engine.generate([Request(LAW_PROMPT, 3, dataclasses.replace(LAW, seed=s)) for s in seeds])
    law = reply_law(loaded.target, LAW_PROMPT, LAW, 3, loaded.eos_ids)
    counts = collections.Counter(tuple(d.token_ids) for d in done)
    assert set(counts) <= set(law), "a reply the target cannot sample"
    replies = sorted(law)
    expected = np.array([law[r] for r in replies]) * LAW_SEEDS
    observed = np.array([counts[r] for r in replies], dtype=float)
    pooled = expected < 10  # pool rare replies so the statistic is valid
    observed = np.append(observed[~pooled], observed[pooled].sum())
    expected = np.append(expected[~pooled], expected[pooled].sum())
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi_square_critical(len(observed) - 1), statistic
    # Every reply whose first token is not an eos drafts that one round. About 70% of its
    # drafts are kept (703 of 1000; see surer_drafter): half is the floor, and at least a
    # tenth must be rejected for the law after a rejection to be tested at all.
    assert_drafted(done, sum(len(d.token_ids) >= 1 for d in done), LAW_SEEDS // 2)
    assert sum(d.draft.accepted for d in done) < 0.9 * LAW_SEEDS, "the test needs rejections"


def test_seeded_sampling_ignores_its_neighbours(sampled_pair):
    """A lane's draws depend on its own seed and positions only."""
    target, drafter = sampled_pair
    request = lambda seed, prompt=SAMPLED_PROMPT: Request(prompt, 12, SamplingParams(seed=seed, **SAMPLING))
    (alone,) = engine_for(target, drafter, None, 4, lanes=1).generate([request(7)])
    crowd = engine_for(target, drafter, None, 4, lanes=4).generate([request(1, [1, 50, 51]), request(7), request(3), request(9, [1, 60])])
    (plain,) = engine_for(target, lanes=1).generate([request(7)])
    assert crowd[1].token_ids == alone.token_ids == plain.token_ids
    for drafted in (alone, crowd[1]):  # 8 drafted rounds keep 3 drafts: the floor asks for one
        assert_drafted([drafted], fewest_drafted_rounds([plain.token_ids], 4), 1)


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
        if extra:  # at a fixed width every round but the last drafts (without one, this machine's guards decide)
            width = int(extra[-1])
            assert drafted["draft"]["drafted_rounds"] >= fewest_drafted_rounds([plain["token_ids"]], width)
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

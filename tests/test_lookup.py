"""Prompt lookup beside the drafter (lanes/lookup.py, RoundRunner._looked_up).

The n-gram index proposes what followed the latest earlier occurrence of the longest
suffix, as a brute-force search over the tokens would; lookup chances count verify
outcomes over their prior exactly as documented; a lane takes a looked-up draft only
where its expected yield beats the drafter's; and whatever is looked up, the target
verifies it, so drafted output with lookup on equals plain output token for token
(greedy and seeded sampling, dense and MoE, one lane and four at once), with lookups
counted so that the equality is not vacuous. The warm-up rehearsal, which does look
up, hands back unlearned lookup chances and drafter timings.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from lanes.detokenize import IncrementalDetokenizer
from lanes.engine import Engine
from lanes.lane import Lane, Request
from lanes.lookup import MAX_NGRAM, NgramIndex
from lanes.pricing import PRIOR_FAILED, PRIOR_SURVIVED, CountedChances, chain_chances
from lanes.round import DRAFTER_YIELD_WINDOWS, MIN_DRAFTER_WINDOWS, RoundRunner
from lanes.sampling import SamplingParams
from tests.priced import FlatCosts, tiny_engine

# ---- NgramIndex --------------------------------------------------------------------------------


def reference_proposal(tokens: list[int], width: int, min_ngram: int = 1, max_ngram: int = MAX_NGRAM):
    """The definition, by brute force: for n from max_ngram down to min_ngram, the latest
    start i of the last n tokens that is not the suffix itself (i + n < len(tokens), so a
    token followed it), and the `width` tokens after it, in the sequence extended by the
    copy itself where it runs past the end."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                extended = list(tokens)
                for k in range(width):
                    extended.append(extended[i + n + k])
                return extended[len(tokens) :], n
    return [], 0


def index_of(tokens: list[int], max_ngram: int = MAX_NGRAM) -> NgramIndex:
    index = NgramIndex(max_ngram)
    index.extend(tokens)
    return index


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    # (1, 2, 3) occurred once, followed by 10; (2, 3) occurred later, followed by 11.
    tokens = [1, 2, 3, 10, 20, 2, 3, 11, 30, 1, 2, 3]
    assert index_of(tokens).propose(2) == ([10, 20], 3)


def test_the_latest_earlier_occurrence_wins():
    # (1, 2) was followed by 7, then by 8: the later one is copied.
    assert index_of([1, 2, 7, 1, 2, 8, 1, 2]).propose(3) == ([8, 1, 2], 2)


def test_the_current_suffix_never_matches_itself():
    assert index_of([4, 5, 6]).propose(3) == ([], 0)
    # In 7 7 7 the 3-gram occurs only as the suffix: the 2-gram (7, 7) at 0 matches.
    assert index_of([7, 7, 7]).propose(3) == ([7, 7, 7], 2)
    assert index_of([7, 7]).propose(3) == ([7, 7, 7], 1)
    assert NgramIndex().propose(3) == ([], 0)


def test_min_ngram_ignores_shorter_matches():
    index = index_of([3, 9, 4, 3])  # only 3 occurred before
    assert index.propose(4, min_ngram=1) == ([9, 4, 3, 9], 1)
    assert index.propose(4, min_ngram=2) == ([], 0)
    index = index_of([5, 6, 1, 9, 6, 2, 5, 6])  # (5, 6) occurred; 6 alone more lately
    assert index.propose(2, min_ngram=2) == ([1, 9], 2)
    assert index.propose(2, min_ngram=3) == ([], 0)


def test_a_copy_that_reaches_the_end_goes_on_through_itself():
    # (1, 2) last began at 0: 3 4 1 2 follow it, then what followed the copied 1 2: 3.
    assert index_of([1, 2, 3, 4, 1, 2]).propose(5) == ([3, 4, 1, 2, 3], 2)
    # A loop of period p proposes the whole width, not the p tokens one period back.
    assert index_of([5] + [32] * 6).propose(9) == ([32] * 9, 3)
    assert index_of([5, 1, 2, 1, 2, 1, 2]).propose(5) == ([1, 2, 1, 2, 1], 3)


def test_the_index_agrees_with_a_brute_force_search_however_it_is_extended():
    """Random short sequences over small alphabets (so matches of every length occur),
    checked after every token when extended one at a time, and after random chunks."""
    rng = np.random.default_rng(20)
    cases = 0
    for _ in range(300):
        alphabet, length = int(rng.integers(2, 6)), int(rng.integers(0, 30))
        tokens = [int(t) for t in rng.integers(0, alphabet, length)]
        max_ngram = int(rng.integers(1, MAX_NGRAM + 2))
        width, min_ngram = int(rng.integers(1, 7)), int(rng.integers(1, max_ngram + 1))
        one_by_one = NgramIndex(max_ngram)
        for end, token in enumerate(tokens, start=1):
            one_by_one.extend([token])
            assert one_by_one.propose(width, min_ngram) == reference_proposal(tokens[:end], width, min_ngram, max_ngram)
            cases += 1
        chunked, start = NgramIndex(max_ngram), 0
        while start < len(tokens):
            stop = start + int(rng.integers(1, 6))
            chunked.extend(tokens[start:stop])
            start = stop
        at_once = index_of(tokens, max_ngram)
        expected = reference_proposal(tokens, width, min_ngram, max_ngram)
        assert chunked.propose(width, min_ngram) == at_once.propose(width, min_ngram) == expected
        assert chunked.tokens == at_once.tokens == tokens
    assert cases > 2000


# ---- CountedChances ----------------------------------------------------------------------------


def test_counted_chances_start_at_the_prior():
    assert (PRIOR_SURVIVED, PRIOR_FAILED) == (3, 1)
    chances = CountedChances(MAX_NGRAM + 1, 5)
    for n in range(1, MAX_NGRAM + 1):
        assert chances.confidences(n, 5) == [0.75] * 5
    assert chances.confidences(2, 3) == [0.75] * 3


def test_an_outcome_counts_survivors_and_the_first_failure_only():
    chances = CountedChances(MAX_NGRAM + 1, 5)
    # 4 drafts verified, 1 kept: position 1 survived, 2 failed, 3 and 4 were never
    # judged (they came after a failure), 5 was not verified.
    chances.observe(2, 4, 1)
    assert chances.confidences(2, 5) == [4 / 5, 3 / 5, 0.75, 0.75, 0.75]
    # All 3 verified drafts kept: no failure is counted at position 4, which was not verified.
    chances.observe(2, 3, 3)
    assert chances.confidences(2, 5) == [5 / 6, 4 / 6, 4 / 5, 0.75, 0.75]
    # Nothing kept of 2: one failure at position 1.
    chances.observe(2, 2, 0)
    assert chances.confidences(2, 5) == [5 / 7, 4 / 6, 4 / 5, 0.75, 0.75]
    chances.observe(2, 0, 0)  # nothing verified: nothing learned
    assert chances.confidences(2, 5) == [5 / 7, 4 / 6, 4 / 5, 0.75, 0.75]
    # Each match length learns apart.
    assert chances.confidences(1, 5) == chances.confidences(3, 5) == [0.75] * 5
    chances.observe(3, 5, 5)
    assert chances.confidences(3, 5) == [4 / 5] * 5
    assert chances.confidences(2, 5) == [5 / 7, 4 / 6, 4 / 5, 0.75, 0.75]


@pytest.mark.parametrize("depth, accepted", [(2, 3), (6, 0), (6, 6), (1, -1)])
def test_impossible_outcomes_are_refused(depth, accepted):
    with pytest.raises(ValueError, match="accepted"):
        CountedChances(MAX_NGRAM + 1, 5).observe(1, depth, accepted)


# ---- RoundRunner's choice between lookup and the drafter ---------------------------------------


@pytest.fixture(scope="module")
def dense_pair(dense_dir, drafter_dir):
    loaded = open_target(dense_dir, max_lanes=2)
    drafter = load_drafter(drafter_dir, loaded.target.model, loaded.target.config, max_lanes=2)
    return loaded, drafter


@pytest.mark.parametrize("lookup", [-1, 4, 9])
def test_prompt_lookup_outside_its_range_is_refused_by_flag_name(lookup, dense_pair):
    loaded, drafter = dense_pair
    with pytest.raises(ValueError, match=rf"--prompt-lookup must be within 0\.\.3 .*got {lookup}"):
        RoundRunner(loaded.target, drafter, draft_width=10, prompt_lookup=lookup)
    for allowed in range(MAX_NGRAM + 1):
        assert RoundRunner(loaded.target, drafter, draft_width=10, prompt_lookup=allowed).prompt_lookup == allowed


def test_prompt_lookup_is_checked_without_a_drafter_and_off_there(dense_pair):
    loaded, _ = dense_pair
    with pytest.raises(ValueError, match="--prompt-lookup must be within 0..3"):
        RoundRunner(loaded.target, None, prompt_lookup=7)
    assert RoundRunner(loaded.target, None, prompt_lookup=2).prompt_lookup == 0  # nothing to draft beside


# A lane whose last three tokens (5, 6, 7) occurred at its prompt's start, followed by nine
# distinct tokens: a full 9-token proposal with a 3-gram match. And one with no match.
MATCHED = ([1, 5, 6, 7, *range(30, 39), 40, 41, 5, 6], [7])
COPIED = list(range(30, 39))
UNMATCHED = ([1, 20, 21, 22], [23])


def make_lane(loaded, prompt_and_generated, max_tokens=64) -> Lane:
    prompt, generated = prompt_and_generated
    lane = Lane(Request(prompt, max_tokens), loaded.eos_ids, loaded.target.context_limit,
                IncrementalDetokenizer(loaded.tokenizer.decode))
    lane.generated = list(generated)
    return lane


def runner_with(dense_pair, drafter_yield: float, prompt_lookup=1, windows=MIN_DRAFTER_WINDOWS, **kwargs) -> RoundRunner:
    """A runner verifying 9 drafts a round whose drafter kept `drafter_yield` of them a
    window, over `windows` windows at the short contexts of MATCHED and UNMATCHED. No
    cost table: yields alone are weighed."""
    loaded, drafter = dense_pair
    runner = RoundRunner(loaded.target, drafter, draft_width=10, prompt_lookup=prompt_lookup, **kwargs)
    runner.drafter_record(len(MATCHED[0])).yields.extend([drafter_yield] * windows)
    return runner


def learn(runner: RoundRunner, n: int, accepted: int, times: int) -> None:
    """Greedy lanes' lookups after `n`-token matches kept `accepted` of a full window
    `times` times, at the short contexts of MATCHED and UNMATCHED."""
    for _ in range(times):
        runner.counts(True, len(MATCHED[0])).observe(n, runner.proposals, accepted)


def looked_up(runner: RoundRunner, lanes: list[Lane]) -> list[int]:
    """Indices of the lanes that take a looked-up draft."""
    chosen = runner._looked_up(lanes, lanes)
    return [i for i, lane in enumerate(lanes) if id(lane) in chosen]


def test_a_lane_takes_the_lookup_only_where_it_beats_the_drafters_yield(dense_pair):
    loaded, _ = dense_pair
    lanes = [make_lane(loaded, MATCHED), make_lane(loaded, UNMATCHED)]
    # The drafter keeps 6 of 9 drafts a window: worth 7 tokens a round. Lookups of 3-gram
    # matches failed at once 20 times: c_31 = 3/24, the window is worth about 1.5 tokens.
    low = runner_with(dense_pair, 6)
    learn(low, 3, 0, 20)
    assert looked_up(low, lanes) == []
    # Lookups of 3-gram matches kept all 9 drafts 40 times: c_3k = 43/44, the window is
    # worth 1 + sum of 0.977^k = 9.0 tokens, more than the drafter's 7.
    high = runner_with(dense_pair, 6)
    learn(high, 3, 9, 40)
    assert looked_up(high, lanes) == [0]  # the lane with no match drafts whatever
    draft = high._looked_up(lanes, lanes)[id(lanes[0])]
    assert draft.tokens == COPIED and draft.ngram == 3
    assert draft.chances == chain_chances([43 / 44] * 9)
    # What 1-gram lookups taught does not price a 3-gram match.
    other = runner_with(dense_pair, 6)
    learn(other, 1, 9, 40)
    assert looked_up(other, lanes) == []


def test_the_prior_is_tried_against_a_modest_drafter_and_the_drafters_time_counts(dense_pair):
    loaded, _ = dense_pair
    lanes = [make_lane(loaded, MATCHED)]
    # The prior window of 9: 1 + sum of 0.75^k = 3.77 tokens.
    assert looked_up(runner_with(dense_pair, 2), lanes) == [0]  # the drafter's 3 are less
    assert looked_up(runner_with(dense_pair, 3), lanes) == []  # its 4 are more
    # A drafter forward as long as the verify round halves the drafter's tokens per second:
    # its 4 tokens a round weigh 2 against the lookup's 3.77.
    timed = runner_with(dense_pair, 3, costs=FlatCosts())
    timed._draft_seconds = 1.0
    assert looked_up(timed, lanes) == [0]
    timed._draft_seconds = None  # not timed yet: its forward counts as free
    assert looked_up(timed, lanes) == []


def test_before_the_drafter_has_a_yield_a_lookup_is_taken_where_it_expects_to_keep_a_draft(dense_pair):
    loaded, _ = dense_pair
    lanes = [make_lane(loaded, MATCHED)]
    # Fewer than MIN_DRAFTER_WINDOWS windows: the drafter's yield is not weighed, however
    # high. The prior's 9 copies expect 2.77 kept drafts: taken.
    early = runner_with(dense_pair, 9, windows=MIN_DRAFTER_WINDOWS - 1)
    assert looked_up(early, lanes) == [0]
    learn(early, 3, 0, 20)  # c_31 = 3/24: 0.46 kept drafts expected, less than one
    assert looked_up(early, lanes) == []
    # A lane with 2 tokens left copies one draft, kept 0.75 times under the prior: not
    # taken before the drafter has a yield, taken against a drafter that keeps nothing.
    one_left = make_lane(loaded, MATCHED, max_tokens=len(MATCHED[1]) + 2)
    assert looked_up(runner_with(dense_pair, 0, windows=0), [one_left]) == []
    assert looked_up(runner_with(dense_pair, 0), [one_left]) == [0]


def test_greedy_and_sampled_lanes_learn_their_counted_chances_apart(dense_pair):
    loaded, _ = dense_pair
    greedy = make_lane(loaded, MATCHED)
    sampled = make_lane(loaded, MATCHED)
    sampled.request.sampling = SamplingParams(temperature=0.7, seed=1)
    runner = runner_with(dense_pair, 2)
    # Sampled lanes' copies failed at once 20 times; greedy lanes still stand at the prior.
    for _ in range(20):
        runner.counts(False, sampled.context).observe(3, runner.proposals, 0)
    assert looked_up(runner, [greedy, sampled]) == [0]


def test_counted_chances_are_kept_per_context_band(dense_pair):
    loaded, _ = dense_pair
    short = make_lane(loaded, MATCHED)
    long = make_lane(loaded, (MATCHED[0], [7] * 5000))  # 5019 tokens: the 8K band
    runner = runner_with(dense_pair, 2)
    g = runner.proposals
    # The long lane's drafter drafts failed at once 20 times: its first draft is priced at
    # 3/24, the short lane's still at the prior, and what each lane learns goes to its band.
    for _ in range(20):
        runner._learn(long, 0, g, 0, [0] * g, [0] * g)
    assert runner._counted(0, long, g) == chain_chances([3 / 24] + [0.75] * (g - 1))
    assert runner._counted(0, short, g) == chain_chances([0.75] * g)
    runner._learn(short, 0, g, g, [0] * g, [0] * g)
    assert runner._counted(0, short, g) == chain_chances([4 / 5] * g)
    assert runner._counted(0, long, g) == chain_chances([3 / 24] + [0.75] * (g - 1))
    # A lane that grows into the next band leaves its old band's counts behind.
    assert runner.counts(True, 8192) is runner.counts(True, long.context) is not runner.counts(True, 8193)


def test_the_drafters_yield_is_kept_per_context_band(dense_pair):
    loaded, _ = dense_pair
    g = 9
    short = make_lane(loaded, MATCHED)
    long = make_lane(loaded, (MATCHED[0], [7] * 2100), max_tokens=2200)  # 2117 tokens: the 4K band
    assert long.remaining > g
    # The drafter keeps 8 of 9 drafts a window at the short lanes' band: a 3-gram copy
    # there loses to it. At the long lane's band it has no yield yet, then keeps none:
    # the same copy is taken, however the short band's drafter does.
    runner = runner_with(dense_pair, 8)
    assert looked_up(runner, [short]) == []
    assert looked_up(runner, [long]) == [0]
    for _ in range(MIN_DRAFTER_WINDOWS):
        runner._learn(long, 0, g, 0, [0] * g, [0] * g)
    assert looked_up(runner, [long]) == [0] and looked_up(runner, [short]) == []
    assert runner.drafter_record(long.context).mean_yield() == 0.0
    assert runner.drafter_record(len(MATCHED[0])).mean_yield() == 8.0
    # A band's yield is the mean of its recent windows only.
    record = runner.drafter_record(long.context)
    record.yields.extend([4] * DRAFTER_YIELD_WINDOWS)
    assert len(record.yields) == DRAFTER_YIELD_WINDOWS and record.mean_yield() == 4.0
    assert runner.drafter_record(4096) is record is not runner.drafter_record(4097)


def test_confidences_are_calibrated_per_context_band(dense_dir, drafter_dir):
    # Rounds that read the proposal before pricing calibrate its confidences; a lane
    # learns into, and is calibrated by, its own context band's calibrator.
    engine = tiny_engine(dense_dir, drafter_dir, lanes=2, price_live=True)
    short, long = Request([1 + i % 300 for i in range(40)], 16), Request([1 + i % 300 for i in range(2100)], 16)
    completions = engine.generate([short, long])
    runner = engine.rounds
    assert set(runner.drafter_records) == {2048, 4096}
    for request, completion in zip((short, long), completions):
        windows = completion.draft.drafted_rounds - completion.draft.looked_up_rounds
        assert windows > 0
        assert runner.drafter_record(len(request.prompt)).calibrator.sample_counts[0] == windows


def test_in_a_round_where_some_lane_drafts_no_lookup_counts_the_drafters_forward_saved(dense_pair):
    loaded, _ = dense_pair
    matched, unmatched = make_lane(loaded, MATCHED), make_lane(loaded, UNMATCHED)
    # The prior's window (3.77 tokens) loses to a drafter keeping 3 (4 tokens) unless the
    # drafter's forward is saved, which halves its tokens per second (FlatCosts: a verify
    # round takes 1 s, as does the drafter here).
    runner = runner_with(dense_pair, 3, costs=FlatCosts())
    runner._draft_seconds = 1.0
    assert looked_up(runner, [matched]) == [0]
    # With a lane that has no match the drafter runs anyway: nothing is saved.
    assert looked_up(runner, [matched, unmatched]) == []


def test_lookup_respects_its_settings_and_follows_the_lane(dense_pair):
    loaded, _ = dense_pair
    lanes = [make_lane(loaded, MATCHED)]
    assert looked_up(runner_with(dense_pair, 0), lanes) == [0]
    assert looked_up(runner_with(dense_pair, 0, prompt_lookup=0), lanes) == []
    # prompt_lookup is the shortest match copied: (5, 6, 7) is a 3-gram match.
    assert looked_up(runner_with(dense_pair, 0, prompt_lookup=3), lanes) == [0]
    two_gram = ([1, 6, 7, 50, 51, 52], [6, 7])  # (6, 7) occurred, (x, 6, 7) did not
    assert looked_up(runner_with(dense_pair, 0, prompt_lookup=2), [make_lane(loaded, two_gram)]) == [0]
    assert looked_up(runner_with(dense_pair, 0, prompt_lookup=3), [make_lane(loaded, two_gram)]) == []
    # A lane with 4 tokens left copies 3 drafts: the 4th is the target's own token.
    short = make_lane(loaded, MATCHED, max_tokens=len(MATCHED[1]) + 4)
    runner = runner_with(dense_pair, 0)
    assert runner._looked_up([short], [short])[id(short)].tokens == COPIED[:3]
    # The lane's index follows its tokens as they are committed.
    lane = make_lane(loaded, UNMATCHED)
    assert looked_up(runner, [lane]) == []
    lane.generated += [21]
    assert runner._looked_up([lane], [lane])[id(lane)].tokens == [22, 23, 21] * 3  # copied on through itself
    assert lane.ngrams.tokens == UNMATCHED[0] + [23, 21]


# ---- exactness through the engine ----------------------------------------------------------------

MAX_TOKENS = 64  # room for a loop to set in and run for a while
TEMPERATURE = 0.5  # sampled, yet peaked enough for some replies to loop


def looping_prompt(seed: int) -> list[int]:
    """A phrase of 2 to 5 tokens, four times over."""
    phrase = [int(t) for t in np.random.default_rng(seed).integers(15, 500, 2 + seed % 4)]
    return [1] + phrase * 4


# Phrase seeds whose replies loop on each tiny target (found by a search over 128 seeds):
# the first two greedy, the last two sampled at TEMPERATURE with the phrase seed as the
# request's seed. Repeated text is what lookup finds; replies that do not loop would give
# it a handful of 1-gram matches at most.
LOOPING = {"dense": (39, 2, 15, 68), "moe": (48, 111, 54, 105)}
# Served first on each engine, so that the drafter has MIN_DRAFTER_WINDOWS windows (its
# yield) before the looping replies start: lookup is weighed against it from their first
# round. 32 tokens: random drafts are nearly always rejected, so about 30 drafter rounds.
WARM_SEED, WARM_TOKENS = 0, 32


def request(seed: int, sampled: bool, max_tokens: int = MAX_TOKENS) -> Request:
    params = SamplingParams(temperature=TEMPERATURE, seed=seed) if sampled else SamplingParams()
    return Request(looping_prompt(seed), max_tokens, params)


def warm_request(sampled: bool) -> Request:
    return request(WARM_SEED, sampled, WARM_TOKENS)


@pytest.fixture(scope="module")
def models(dense_dir, drafter_dir, moe_dir, moe_drafter_dir):
    return {"dense": (dense_dir, drafter_dir), "moe": (moe_dir, moe_drafter_dir)}


def engine_for(target_dir, drafter_dir=None, width=None, lanes=1, lookup=0, timed=False) -> Engine:
    """Priced windows drafted every round on any machine, or `timed` as a server prices
    them (the caller warms it up)."""
    return tiny_engine(target_dir, drafter_dir, lanes, timing=None if timed else "flat", draft_width=width, prompt_lookup=lookup)


@pytest.fixture(scope="module")
def solo(models):
    """Each model's replies, plain and each run alone: the warm prompt's, then the loops'."""

    @functools.cache
    def replies(model: str, sampled: bool) -> tuple[list[int], list[list[int]]]:
        engine = engine_for(models[model][0])
        warm, *loops = engine.generate([warm_request(sampled)] + [request(s, sampled) for s in LOOPING[model]])
        return warm.token_ids, [c.token_ids for c in loops]

    return replies


def fewest_looked_up_rounds(prompt: list[int], reply: list[int], width: int, min_ngram: int) -> int:
    """Looked-up rounds a lane that wrote `reply` must have taken, where every round whose
    anchor has a match of at least `min_ngram` tokens copies it (see the floor's comment
    in the tests). A round's anchor lies at most `width` tokens past the one before, so a
    stretch of L consecutive anchor positions with a match holds at least L // width
    rounds' anchors. Positions within 2 tokens of the end are left out: there a lane may
    have too few tokens left to draft."""
    rounds = stretch = 0
    for a in range(len(reply)):
        if a <= len(reply) - 3 and reference_proposal(prompt + reply[: a + 1], 1, min_ngram)[0]:
            stretch += 1
        else:
            rounds, stretch = rounds + stretch // width, 0
    return rounds + stretch // width


def serve_with_lookup(engine: Engine, model: str, sampled: bool):
    """The warm request alone, then the looping ones (as many at once as the engine has
    lanes)."""
    (warm,) = engine.generate([warm_request(sampled)])
    yields = engine.rounds.drafter_record(len(warm_request(sampled).prompt)).yields
    assert len(yields) >= MIN_DRAFTER_WINDOWS, "the warm request left the drafter without a yield"
    assert sum(yields) / len(yields) < 0.25, "the floor below counts on a drafter that keeps almost nothing"
    loops = engine.generate([request(s, sampled) for s in LOOPING[model]])
    return warm, loops


def lookup_floor(model: str, replies: list[list[int]], width: int, lookup: int) -> int:
    """Looked-up rounds the looping replies must have taken. The random tiny drafter keeps
    almost none of its drafts (yield under 0.25, checked above), so a match's window,
    worth 1 + E (E >= its first chance, which stays high where replies loop), beats the
    drafter's (1 + yield) x its share of the round's time: every round whose anchor has a
    match copies, and fewest_looked_up_rounds counts those in the plain replies. (Observed
    counts are 3 to 10 times this floor: with random drafts, more rounds take a token.)"""
    floor = sum(fewest_looked_up_rounds(looping_prompt(s), reply, width, lookup) for s, reply in zip(LOOPING[model], replies))
    assert floor >= 2, "the replies do not loop: the test would not see lookups"
    return floor


PRICED_WIDTH = 10  # the widest window priced rounds verify: the anchor and the drafter's block of 9


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("width, lookup", [(4, 1), (None, 2)])  # fixed and priced (four lanes: the other way round)
def test_drafted_with_lookup_equals_plain(model, sampled, width, lookup, models, solo):
    warm_plain, plain = solo(model, sampled)
    engine = engine_for(*models[model], width=width, lanes=1, lookup=lookup)
    warm, loops = serve_with_lookup(engine, model, sampled)
    assert warm.token_ids == warm_plain
    assert [c.token_ids for c in loops] == plain
    looked = sum(c.draft.looked_up_rounds for c in loops)
    assert looked >= lookup_floor(model, plain, width or PRICED_WIDTH, lookup)
    # Looked-up rounds are drafted rounds, and the runner learned from them.
    assert all(c.draft.looked_up_rounds <= c.draft.drafted_rounds for c in loops)
    g = engine.rounds.proposals
    learned = [chances for (greedy, _), chances in engine.rounds.counted_chances.items() if greedy != sampled]
    assert any(chances.confidences(n, g) != [0.75] * g for chances in learned for n in range(lookup, MAX_NGRAM + 1))


def mixed_rounds(runner: RoundRunner) -> list[bool]:
    """Spies on the runner's drafting: for each drafted round, whether some of its lanes
    looked up and others drafted."""
    mixed = []
    draft = runner._draft

    def spy(lanes, drafting):
        drafts, proposal = draft(lanes, drafting)
        mixed.append(0 < sum(bool(d.ngram) for d in drafts) < len(drafts))
        return drafts, proposal

    runner._draft = spy
    return mixed


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("width, lookup", [(None, 1), (5, 2)])
def test_four_lanes_with_lookup_equal_their_solo_runs(model, sampled, width, lookup, models, solo):
    # Lanes that look up and lanes that draft share rounds: each keeps its own tokens.
    warm_plain, plain = solo(model, sampled)
    engine = engine_for(*models[model], width=width, lanes=4, lookup=lookup)
    mixed = mixed_rounds(engine.rounds)
    warm, loops = serve_with_lookup(engine, model, sampled)
    assert any(mixed), "no round had both a looked-up and a drafted lane"
    assert warm.token_ids == warm_plain
    assert [c.token_ids for c in loops] == plain
    assert sum(c.draft.looked_up_rounds for c in loops) >= lookup_floor(model, plain, width or PRICED_WIDTH, lookup)


# ---- the warm-up rehearsal -----------------------------------------------------------------------


def test_the_warm_up_rehearsal_leaves_no_lookup_evidence(dense_dir, drafter_dir):
    engine = engine_for(dense_dir, drafter_dir, lanes=4, lookup=1, timed=True)  # as a server is
    runner = engine.rounds
    seen = {"looked_up": 0, "windows": 0, "timed": False}
    looked_up = runner._looked_up

    def spy(lanes, drafting):
        chosen = looked_up(lanes, drafting)
        seen["looked_up"] += len(chosen)
        seen["windows"] = max([seen["windows"]] + [len(record.yields) for record in runner.drafter_records.values()])
        seen["timed"] |= runner._draft_seconds is not None
        return chosen

    runner._looked_up = spy
    engine.warm_up()
    # The rehearsal did learn: a drafter yield and timing, and lookups it chose.
    assert seen["windows"] >= MIN_DRAFTER_WINDOWS and seen["timed"] and seen["looked_up"] > 0
    # What it learned went to throwaway instances.
    assert runner.counted_chances == {} and runner.drafter_records == {}
    assert runner._draft_seconds is None
    assert runner.draft_width is None

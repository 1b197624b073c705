"""Acceptance and seeded sampling: the prefix rule, the counter-based Gumbel noise against
an independent numpy reference, and draws that follow the filtered distribution exactly."""

import mlx.core as mx
import numpy as np
import pytest

from lanes.acceptance import greedy_accept_length
from lanes.sampling import SamplingParams, choose, filtered_logprobs, gumbel_noise, noise_key, row_keys
from tests.priced import assert_drafted, fewest_drafted_rounds


MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def gumbel_noise_reference(key: int, vocab: int) -> np.ndarray:
    """`gumbel_noise` for one row in float64 numpy, written apart from the device code:
    the same 32-bit hash (golden-ratio spread of the index, two mixing rounds), the same
    23-bit uniform strictly inside (0, 1), the Gumbel transform in float64."""
    index = (np.arange(vocab, dtype=np.uint64) * GOLDEN) & MASK32

    def mix(x):
        x = x & MASK32
        x ^= x >> 16
        x = (x * 0x7FEB352D) & MASK32
        x ^= x >> 15
        x = (x * 0x846CA68B) & MASK32
        return x ^ (x >> 16)

    bits = mix((mix(np.uint64(key) ^ index) + np.uint64(key)) & MASK32)
    v = (bits >> 9).astype(np.float64) * 2.0**-23 + 2.0**-24
    return -np.log(-np.log1p(-v))


def test_accepts_the_matching_prefix():
    assert greedy_accept_length([5, 6, 7], [5, 6, 9, 1]) == 2  # 7 != 9
    assert greedy_accept_length([5, 6, 7], [5, 6, 7, 8]) == 3  # all match; 8 is the bonus row
    assert greedy_accept_length([5, 6, 7], [4, 6, 7, 8]) == 0  # later matches do not count
    assert greedy_accept_length([], [3]) == 0
    with pytest.raises(ValueError):
        greedy_accept_length([5, 6], [5])


def test_noise_matches_the_numpy_reference_and_is_gumbel():
    keys = [noise_key(2**63 + 12345, 7), noise_key(0, 0), noise_key(99, 4096)]
    noise = np.array(gumbel_noise(keys, 20_000))
    for row, key in zip(noise, keys):
        assert np.abs(row - gumbel_noise_reference(key, 20_000)).max() < 1e-4  # float32 logs
        # Standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6.
        assert row.mean() == pytest.approx(np.euler_gamma, abs=0.04)
        assert row.var() == pytest.approx(np.pi**2 / 6, rel=0.06)
    assert not np.allclose(noise[0], noise[1])


def test_keys_depend_on_seed_and_position_only():
    assert noise_key(5, 10) == noise_key(5, 10)
    assert len({noise_key(s, p) for s in range(30) for p in range(30)}) == 900
    assert row_keys(5, SamplingParams(temperature=0.7), 10, 3) == [noise_key(5, 10), noise_key(5, 11), noise_key(5, 12)]
    assert row_keys(5, SamplingParams(), 10, 3) == [0, 0, 0]  # greedy lanes draw no noise


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
])
def test_seeded_draws_follow_the_filtered_distribution(params):
    # Chi-square over many seeds at one position: the Gumbel-max draw's law is exactly p.
    vocab, draws = 12, 6000
    logits = mx.array(np.random.default_rng(3).normal(0, 1.5, (1, vocab)), dtype=mx.float32)
    p = np.exp(np.array(filtered_logprobs(logits, [params]))[0])
    tokens = np.array(choose(mx.repeat(logits, draws, axis=0), [params] * draws, [noise_key(s, 17) for s in range(draws)]))
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[p == 0].sum() == 0  # filtered tokens are never drawn
    kept = p > 0
    expected = p[kept] * draws
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum()
    # The 99.9% quantile of chi-square with (kept - 1) degrees of freedom is below 2.5 x dof + 12.
    assert chi2 < 2.5 * (kept.sum() - 1) + 12, (chi2, counts, expected)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = mx.array([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    tokens = choose(logits, [SamplingParams(), SamplingParams(temperature=1.0)], [0, noise_key(1, 1)])
    assert tokens.tolist()[0] == 1
    same = choose(logits, [SamplingParams(), SamplingParams(temperature=1.0)], [0, noise_key(1, 1)])
    assert same.tolist() == tokens.tolist()  # a key reproduces its draw


def test_the_repetition_penalty_matches_a_host_reference(dense_dir, tmp_path):
    """Greedy with a penalty, served by the engine (plain and drafted rounds), against a
    step-by-step loop that penalises every token of the sequence so far on the host."""
    from families.lfm2 import open_target
    from families.lfm2.drafter import load_drafter
    from families.lfm2.tiny_drafter import make_tiny_drafter
    from lanes.engine import Engine, EngineConfig
    from lanes.lane import Request

    penalty, steps = 1.3, 24
    prompts = [[1, 40, 41, 42, 40, 41], [1, 300, 12, 12, 77]]
    loaded = open_target(dense_dir, max_lanes=1)
    references = []
    for prompt in prompts:
        lane = loaded.target.open_lane()
        logits, _ = loaded.target.prefill(lane, prompt)
        sequence, out = list(prompt), []
        for _ in range(steps):
            x = np.array(logits.astype(mx.float32))
            seen = sorted(set(sequence))
            x[seen] = np.where(x[seen] > 0, x[seen] / np.float32(penalty), x[seen] * np.float32(penalty))
            token = int(x.argmax())
            if token in loaded.eos_ids:
                break
            out.append(token)
            sequence.append(token)
            step = loaded.target.forward([lane], [[token]])
            loaded.target.commit(step, [1])
            logits = step.logits[0]
        loaded.target.close_lane(lane)
        references.append(out)

    requests = lambda: [Request(p, steps, SamplingParams(repetition_penalty=penalty)) for p in prompts]
    served = open_target(dense_dir, max_lanes=2)
    plain = Engine(served.target, served.tokenizer, served.eos_ids, None, EngineConfig(max_streams=2)).generate(requests())
    assert [d.token_ids for d in plain] == references
    drafter_dir = make_tiny_drafter(tmp_path / "drafter", dense_dir, seed=8, block_size=5)
    drafter = load_drafter(drafter_dir, served.target.model, served.target.config, max_lanes=2)
    drafted = Engine(served.target, served.tokenizer, served.eos_ids, drafter, EngineConfig(max_streams=2, draft_width=6))
    done = drafted.generate(requests())
    assert [d.token_ids for d in done] == references
    # Every round at width 6 drafts but a lane's last; random drafts are nearly always
    # rejected, so no floor on accepts: what is checked is each verify row's penalty.
    assert_drafted(done, fewest_drafted_rounds(references, 6), 0)


def _lane(sampling: SamplingParams, prompt: list[int], generated: list[int]):
    from lanes.detokenize import IncrementalDetokenizer
    from lanes.lane import Lane, Request

    lane = Lane(Request(prompt, 16, sampling=sampling), frozenset(), 100, IncrementalDetokenizer(lambda ids: ""))
    lane.generated = list(generated)
    return lane


def test_the_drafters_pick_penalises_what_each_verify_row_will_have_seen():
    """Row k of a proposal is picked with the lane's repetition penalty over its tokens
    and the drafts before row k, as the verify's row k will choose; without a penalty
    greedy lanes keep the plain argmax (no pick at all)."""
    from lanes.penalty import SeenTokens
    from lanes.round import drafter_pick

    seen = SeenTokens(8)
    logits = mx.array([[0.0, 1.0, 2.0, 3.0, 2.5, 0.5, 0.0, 0.0]])
    penalised = _lane(SamplingParams(temperature=0, repetition_penalty=4.0), [1, 2], [3])
    pick = drafter_pick([penalised], 3, seen)
    # Seen 1, 2, 3 fall to 0.25, 0.5, 0.75: row 0 takes 4 (2.5). Row 1 has seen draft 4
    # too (0.625), so it takes 3 (0.75), and row 2 likewise.
    assert [pick(logits, k).tolist() for k in range(3)] == [[4], [3], [3]]
    assert drafter_pick([_lane(SamplingParams(temperature=0), [1, 2], [3])], 3, seen) is None
    unpenalised = drafter_pick([_lane(SamplingParams(temperature=0.5, seed=3), [1, 2], [3]), penalised], 3, seen)
    both = mx.concatenate([logits, logits])
    assert unpenalised(both, 0).tolist()[1] == 4  # the penalised lane still penalised beside a sampled one

"""The DSpark drafter against an independent float64 numpy reference, and its batching.

The reference below is written from DESIGN.md section 4, not from the drafter package: context
rows `hidden_norm(fc(taps))` give each layer's keys (k_norm, interleaved RoPE) and
values at positions 0..n-1; the block `[anchor] + [mask] * (g-1)` at positions n..n+g-1
attends over context and block with no mask; the final norm feeds the target's tied
table; the Markov chain and the confidence head follow.

Tolerances (float32 MLX vs float64 numpy): chain logits within 1e-4 absolute (they reach
~30; observed ~2e-5), confidences within 1e-5; proposals equal. Batched vs alone (both
float32, other reductions): logits within 1e-4 absolute, confidences 1e-6, proposals equal.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

from families.lfm2.drafter import DSparkDrafter, load_drafter, validate_proposal
from families.lfm2.loader import load_model
from families.lfm2.target import Lfm2Target
from families.lfm2.tiny import make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter

PROMPTS = [list(range(20, 23)), list(range(40, 48)), list(range(60, 73)), list(range(100, 106))]
ANCHORS = [301, 17, 255, 42]


# --- an independent float64 reference ---------------------------------------------------


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_interleaved(x, positions, theta):
    """x [T, heads, D]: pair (2i, 2i+1) turns by position * theta^(-2i/D)."""
    d = x.shape[-1]
    angle = positions[:, None] * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class Reference:
    def __init__(self, drafter_dir, target_dir):
        raw = json.loads((drafter_dir / "config.json").read_text())
        self.cfg = {**raw, **raw.get("dflash_config", {})}
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
        self.embed = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float64)

    def propose(self, taps, anchor, g, pick=None):
        """taps [n, n_taps*H_t] of the committed rows -> tokens [g], logits [g, V], confidences [g]."""
        cfg, w = self.cfg, self.w
        eps, theta, d = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        n = taps.shape[0]
        context = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        h = self.embed[[anchor] + [cfg["mask_token_id"]] * (g - 1)]
        context_pos, block_pos = np.arange(n, dtype=np.float64), n + np.arange(g, dtype=np.float64)
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            a = p + "self_attn."

            def keys(rows, positions):
                k = rms((rows @ w[a + "k_proj.weight"].T).reshape(-1, kv_heads, d), w[a + "k_norm.weight"], eps)
                return rope_interleaved(k, positions, theta), (rows @ w[a + "v_proj.weight"].T).reshape(-1, kv_heads, d)

            x = rms(h, w[p + "input_layernorm.weight"], eps)
            q = rope_interleaved(rms((x @ w[a + "q_proj.weight"].T).reshape(g, heads, d), w[a + "q_norm.weight"], eps), block_pos, theta)
            k_ctx, v_ctx = keys(context, context_pos)  # no input_layernorm on the context
            k_blk, v_blk = keys(x, block_pos)
            k = np.repeat(np.concatenate([k_ctx, k_blk]), heads // kv_heads, axis=1)
            v = np.repeat(np.concatenate([v_ctx, v_blk]), heads // kv_heads, axis=1)
            attn = softmax(np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d))  # no mask at all
            o = np.einsum("hqk,khd->qhd", attn, v).reshape(g, heads * d)
            h = h + o @ w[a + "o_proj.weight"].T
            x = rms(h, w[p + "post_attention_layernorm.weight"], eps)
            h = h + (silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        h = rms(h, w["norm.weight"], eps)
        base = h @ self.embed.T
        w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
        tokens, logits, confidences, prev = [], [], [], anchor
        for k in range(g):
            l_k = base[k] + w2 @ w1[prev]
            if cfg["enable_confidence_head"]:
                features = np.concatenate([h[k], w1[prev]]) if cfg.get("confidence_head_with_markov", True) else h[k]
                z = w["confidence_head.proj.weight"] @ features + w["confidence_head.proj.bias"]
                confidences.append(1 / (1 + np.exp(-z[0])))
            prev = int(np.argmax(l_k)) if pick is None else pick(l_k, k)
            tokens.append(prev)
            logits.append(l_k)
        return np.array(tokens), np.array(logits), np.array(confidences)


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"), "lfm2", seed=1)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target_dir):
    return make_tiny_drafter(tmp_path_factory.mktemp("drafter"), target_dir, seed=3, block_size=5)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


@pytest.fixture(scope="module")
def prompt_taps(target, drafter_dir):
    """Every prompt row's taps from the real target, as the lane core gets them from prefill."""
    model, cfg = target
    runner = Lfm2Target(model, cfg, max_lanes=len(PROMPTS))
    tap_layers = load_drafter(drafter_dir, model, cfg).tap_layers
    taps = []
    for prompt in PROMPTS:
        _, rows = runner.prefill(runner.open_lane(), prompt, chunk=5, taps=tap_layers)
        taps.append(rows)
    return taps


def placeholder_ids(taps):
    """Token ids to go with tap rows: the drafter only checks that they agree in count."""
    return [[0] * t.shape[0] for t in taps]


def drafter_with_context(path, target, taps, splits=None):
    """A drafter with one lane per taps array, appended in pieces: call j appends rows
    splits[j-1]:splits[j] of every lane (some lanes get none in some calls)."""
    model, cfg = target
    drafter = load_drafter(path, model, cfg)
    lanes = [drafter.open_lane() for _ in taps]
    bounds = splits or [0, max(t.shape[0] for t in taps)]
    for lo, hi in zip(bounds, bounds[1:]):
        rows = [t[lo:hi] for t in taps]
        drafter.append(lanes, rows, placeholder_ids(rows))
    return drafter, lanes


def evaluated(proposal):
    mx.eval(*proposal.arrays())
    conf = None if proposal.confidences is None else np.array(proposal.confidences)
    return np.array(proposal.tokens), np.array(proposal.logits), conf


def assert_matches_reference(proposal, reference, taps, anchors, g, pick=None):
    tokens, logits, conf = evaluated(proposal)
    for i, (rows, anchor) in enumerate(zip(taps, anchors)):
        ref_tokens, ref_logits, ref_conf = reference.propose(np.array(rows, dtype=np.float64), anchor, g, pick)
        np.testing.assert_array_equal(tokens[i], ref_tokens)
        np.testing.assert_allclose(logits[i], ref_logits, rtol=0, atol=1e-4)
        if reference.cfg["enable_confidence_head"]:
            np.testing.assert_allclose(conf[i], ref_conf, rtol=0, atol=1e-5)


# --- tests --------------------------------------------------------------------------------


def test_matches_reference_with_context_appended_over_several_calls(target, target_dir, drafter_dir, prompt_taps):
    reference = Reference(drafter_dir, target_dir)
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps, splits=[0, 2, 7, 9, 13])
    assert [lane.length for lane in lanes] == [len(p) for p in PROMPTS]
    assert_matches_reference(drafter.propose(lanes, ANCHORS), reference, prompt_taps, ANCHORS, drafter.width)

    # A round later: each lane commits a different number of new rows (1..4).
    rng = np.random.default_rng(0)
    new = [mx.array(rng.standard_normal((k, prompt_taps[0].shape[1])).astype(np.float32)) for k in (1, 4, 2, 3)]
    drafter.append(lanes, new, placeholder_ids(new))
    grown = [mx.concatenate([a, b]) for a, b in zip(prompt_taps, new)]
    assert_matches_reference(drafter.propose(lanes, ANCHORS[::-1]), reference, grown, ANCHORS[::-1], drafter.width)


def test_reference_holds_without_markov_in_the_confidence(target, target_dir, tmp_path, prompt_taps):
    path = make_tiny_drafter(tmp_path / "d", target_dir, seed=5, block_size=3, confidence_with_markov=False, nested=False)
    drafter, lanes = drafter_with_context(path, target, prompt_taps)
    assert_matches_reference(drafter.propose(lanes, ANCHORS), Reference(path, target_dir), prompt_taps, ANCHORS, 3)


def test_no_confidence_head_gives_no_confidences(target, target_dir, tmp_path, prompt_taps):
    path = make_tiny_drafter(tmp_path / "d", target_dir, seed=5, confidence=False)
    drafter, lanes = drafter_with_context(path, target, prompt_taps)
    proposal = drafter.propose(lanes, ANCHORS)
    assert proposal.confidences is None
    assert_matches_reference(proposal, Reference(path, target_dir), prompt_taps, ANCHORS, drafter.width)


def test_narrower_width_matches_reference(target, target_dir, drafter_dir, prompt_taps):
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps)
    reference = Reference(drafter_dir, target_dir)
    for g in (1, 2, 4):
        proposal = drafter.propose(lanes, ANCHORS, width=g)
        assert proposal.tokens.shape == (4, g) and proposal.logits.shape == (4, g, 512)
        assert_matches_reference(proposal, reference, prompt_taps, ANCHORS, g)
    for bad in (0, drafter.config.max_width + 1):
        with pytest.raises(ValueError, match="width"):
            drafter.propose(lanes, ANCHORS, width=bad)


def test_batched_equals_each_lane_alone(target, drafter_dir, prompt_taps):
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps)
    tokens, logits, conf = evaluated(drafter.propose(lanes, ANCHORS))
    assert len({tuple(t) for t in tokens}) == len(lanes), "lanes should draft differently"
    # Alone, and in a shuffled order (slots no longer contiguous).
    for i, lane in enumerate(lanes):
        t, l, c = evaluated(drafter.propose([lane], [ANCHORS[i]]))
        np.testing.assert_array_equal(t[0], tokens[i])
        np.testing.assert_allclose(l[0], logits[i], rtol=0, atol=1e-4)
        np.testing.assert_allclose(c[0], conf[i], rtol=0, atol=1e-6)
    order = [2, 0, 3]
    t, l, _ = evaluated(drafter.propose([lanes[i] for i in order], [ANCHORS[i] for i in order]))
    np.testing.assert_array_equal(t, tokens[order])
    np.testing.assert_allclose(l, logits[order], rtol=0, atol=1e-4)


def test_pick_drives_the_chain(target, target_dir, drafter_dir, prompt_taps):
    """A sampler callable replaces argmax, and its picks are what the Markov head reads next."""
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps)
    seen = []

    def second_best(logits, k):
        seen.append(k)
        return mx.argsort(-logits, axis=-1)[:, 1]

    proposal = drafter.propose(lanes, ANCHORS, pick=second_best)
    assert seen == list(range(drafter.width))
    reference = Reference(drafter_dir, target_dir)
    assert_matches_reference(proposal, reference, prompt_taps, ANCHORS, drafter.width, pick=lambda l, k: int(np.argsort(-l)[1]))


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("pick", [None, lambda logits, k: mx.argsort(-logits, axis=-1)[:, 1]], ids=["greedy", "pick"])
def test_a_proposal_without_confidences_drafts_the_same(target, drafter_dir, prompt_taps, compiled, pick):
    """A round priced by counted survival never reads the confidences: left out, the
    drafts and their faults are the same, and there are none to read."""
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps)
    drafter.compiled = compiled
    full = drafter.propose(lanes, ANCHORS, pick=pick, chain_logits=False)
    bare = drafter.propose(lanes, ANCHORS, pick=pick, chain_logits=False, confidences=False)
    assert full.confidences is not None and bare.confidences is None
    mx.eval(*full.arrays(), *bare.arrays())
    assert bare.tokens.tolist() == full.tokens.tolist() and bare.faults.tolist() == full.faults.tolist()


def test_proposing_never_grows_the_context(target, drafter_dir, prompt_taps):
    drafter, lanes = drafter_with_context(drafter_dir, target, prompt_taps)
    lengths = [lane.length for lane in lanes]
    first = evaluated(drafter.propose(lanes, ANCHORS))
    # Another block with other anchors writes other rows past the context ...
    evaluated(drafter.propose(lanes, [5, 6, 7, 8], width=3))
    assert [lane.length for lane in lanes] == lengths
    # ... and the first proposal comes back unchanged.
    again = evaluated(drafter.propose(lanes, ANCHORS))
    np.testing.assert_array_equal(again[0], first[0])
    np.testing.assert_allclose(again[1], first[1], rtol=0, atol=1e-4)


def test_reused_slot_starts_empty(target, target_dir, drafter_dir, prompt_taps):
    model, cfg = target
    drafter = load_drafter(drafter_dir, model, cfg, max_lanes=2)
    long_lane = drafter.open_lane()
    drafter.append([long_lane], [prompt_taps[2]], placeholder_ids([prompt_taps[2]]))
    drafter.close_lane(long_lane)
    lane = drafter.open_lane()
    assert lane.slot == long_lane.slot and lane.length == 0
    drafter.append([lane], [prompt_taps[0]], placeholder_ids([prompt_taps[0]]))  # shorter than what the slot held before
    proposal = drafter.propose([lane], [ANCHORS[0]])
    assert_matches_reference(proposal, Reference(drafter_dir, target_dir), prompt_taps[:1], ANCHORS[:1], drafter.width)
    assert validate_proposal(proposal) == [None]
    assert isinstance(drafter, DSparkDrafter) and drafter.kv_bytes() > 0

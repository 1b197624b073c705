"""Drafter checkpoints: both config layouts, every refusal by name, 8-bit opt-in, and
per-lane draft errors. Each bad checkpoint is a good tiny drafter with one field or
tensor planted."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from families.lfm2.config import CheckpointError
from families.lfm2.drafter import (
    MAX_VERIFY_WIDTH,
    DraftError,
    DSparkConfig,
    check_pairing,
    load_drafter,
    validate_proposal,
)
from families.lfm2.loader import load_model
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter

DELETE = object()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"), "lfm2", seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir)


@pytest.fixture
def drafter_dir(tmp_path, target_dir):
    return make_tiny_drafter(tmp_path / "drafter", target_dir, seed=3)


def plant(path, key, value):
    """Set (or delete) a config field where it sits: inside dflash_config or at top level."""
    config = json.loads((path / "config.json").read_text())
    section = config["dflash_config"] if key in config.get("dflash_config", {}) else config
    if value is DELETE:
        del section[key]
    else:
        section[key] = value
    (path / "config.json").write_text(json.dumps(config))


def plant_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def refused(path, target, match):
    model, cfg = target
    with pytest.raises(CheckpointError, match=match):
        load_drafter(path, model, cfg)


def propose_for(drafter, lanes_taps, anchors, **kwargs):
    lanes = [drafter.open_lane() for _ in lanes_taps]
    drafter.append(lanes, lanes_taps, [[0] * t.shape[0] for t in lanes_taps])
    proposal = drafter.propose(lanes, anchors, **kwargs)
    mx.eval(*proposal.arrays())
    return proposal


def random_taps(counts, seed=0):
    """Stand-in taps for three target layers of width 64."""
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((n, 3 * 64)).astype(np.float32)) for n in counts]


# --- config layouts -----------------------------------------------------------------------


def test_fields_nested_or_at_top_level_read_the_same_and_seeds_repeat(tmp_path, target_dir, target):
    nested = DSparkConfig.from_dir(make_tiny_drafter(tmp_path / "a", target_dir, seed=3))
    top = DSparkConfig.from_dir(make_tiny_drafter(tmp_path / "b", target_dir, seed=3, nested=False))
    assert nested == top
    same = make_tiny_drafter(tmp_path / "c", target_dir, seed=3)
    assert (same / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    assert nested.mask_token_id == 14 and nested.target_layer_ids == (0, 2, 4) and nested.rope_traditional
    check_pairing(nested, target[1])


def test_model_prefix_is_stripped(drafter_dir, target):
    model, cfg = target
    plain = propose_for(load_drafter(drafter_dir, model, cfg), random_taps([5, 3]), [30, 40])
    plant_tensors(drafter_dir, lambda t: t.update({"model." + k: t.pop(k) for k in list(t)}))
    prefixed = propose_for(load_drafter(drafter_dir, model, cfg), random_taps([5, 3]), [30, 40])
    np.testing.assert_array_equal(np.array(prefixed.tokens), np.array(plain.tokens))


def test_block_size_at_the_verify_ceiling_reads_and_past_it_is_refused(drafter_dir, target):
    plant(drafter_dir, "block_size", MAX_VERIFY_WIDTH - 1)
    cfg = DSparkConfig.from_dir(drafter_dir)
    assert cfg.block_size == cfg.width == cfg.max_width == 31
    plant(drafter_dir, "runtime_block_size", 6)
    assert DSparkConfig.from_dir(drafter_dir).width == 6
    for block in (MAX_VERIFY_WIDTH, 100_000):
        plant(drafter_dir, "block_size", block)
        refused(drafter_dir, target, r"'block_size' must be an integer in 1\.\.31")


# --- refusals by name -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("mask_token_id", 512, "mask_token_id"),
        ("mask_token_id", -1, "mask_token_id"),
        ("mask_token_id", DELETE, "mask_token_id"),
        ("target_layer_ids", [0, 2, 2], "target_layer_ids"),
        ("target_layer_ids", [4, 2, 0], "target_layer_ids"),
        ("target_layer_ids", [0, 2, 5], "target_layer_ids"),  # the target's last layer
        ("target_layer_ids", [-1, 2, 4], "target_layer_ids"),
        ("target_layer_ids", [], "target_layer_ids"),
        ("rope_theta", 0, "rope_theta"),
        ("rope_theta", -1e4, "rope_theta"),
        ("rope_theta", float("inf"), "rope_theta"),
        ("rope_theta", "1e4", "rope_theta"),
        ("rope_theta", DELETE, "rope_theta"),
        ("hidden_act", "gelu", "hidden_act"),
        ("markov_rank", 0, "markov_rank"),
        ("markov_rank", 2048, "markov_rank"),
        ("markov_head_type", "mixture", "markov_head_type"),
        ("rms_norm_eps", 0, "rms_norm_eps"),
        ("attention_bias", True, "attention_bias"),
        ("runtime_block_size", 5, "runtime_block_size"),  # wider than block_size 4
        ("num_attention_heads", 3, "num_attention_heads"),
        ("head_dim", 15, "head_dim"),
        ("vocab_size", 1024, "vocab_size"),  # drafter vocab != target vocab
        ("num_target_layers", 8, "num_target_layers"),  # trained for another target
        ("hidden_size", 128, "hidden_size"),
    ],
)
def test_bad_config_field_is_refused_by_name(drafter_dir, target, field, value, match):
    plant(drafter_dir, field, value)
    refused(drafter_dir, target, match)


def test_drafter_for_another_target_is_refused(tmp_path, target_dir, target):
    other = make_tiny_target(tmp_path / "other", "lfm2", seed=4, shape=TinyShape(layers=8))
    path = make_tiny_drafter(tmp_path / "d", other, seed=3, taps=[1, 3, 6])
    refused(path, target, "num_target_layers")
    with pytest.raises(CheckpointError, match="num_target_layers"):
        check_pairing(DSparkConfig.from_dir(path), target[1])


def test_fc_width_must_be_taps_times_target_hidden(drafter_dir, target):
    plant_tensors(drafter_dir, lambda t: t.update({"fc.weight": t["fc.weight"][:, :128]}))
    refused(drafter_dir, target, r"fc\.weight .*3 taps x target hidden 64")


def test_tap_count_must_match_fc(drafter_dir, target):
    plant(drafter_dir, "target_layer_ids", [1, 3])  # two taps, fc still reads three
    refused(drafter_dir, target, r"fc\.weight .*2 taps x target hidden 64")


@pytest.mark.parametrize(
    "name, shape",
    [("markov_head.markov_w1.weight", (256, 64)), ("markov_head.markov_w2.weight", (512, 32)), ("markov_head.markov_w2.weight", (64, 512))],
)
def test_markov_tables_must_be_target_vocab_by_rank(drafter_dir, target, name, shape):
    plant_tensors(drafter_dir, lambda t: t.update({name: np.zeros(shape, np.float32)}))
    refused(drafter_dir, target, rf"{name} .*target vocab 512, markov_rank 64")


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_non_finite_weights_are_refused_by_name(drafter_dir, target, poison):
    def plant_poison(t):
        t["layers.1.mlp.down_proj.weight"][3, 5] = poison

    plant_tensors(drafter_dir, plant_poison)
    refused(drafter_dir, target, r"drafter tensor layers\.1\.mlp\.down_proj\.weight holds NaN or infinite values")


def test_integer_weights_are_refused_by_name(drafter_dir, target):
    plant_tensors(drafter_dir, lambda t: t.update({"norm.weight": t["norm.weight"].astype(np.int32)}))
    refused(drafter_dir, target, r"drafter tensor norm\.weight is int32, not floating point")


def test_missing_and_misshapen_tensors_are_named(drafter_dir, target):
    plant_tensors(drafter_dir, lambda t: t.update({"layers.1.self_attn.k_norm.weight": np.ones(8, np.float32)}))
    refused(drafter_dir, target, r"layers\.1\.self_attn\.k_norm\.weight has shape \(8,\)")
    plant_tensors(drafter_dir, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    refused(drafter_dir, target, r"lacks tensor layers\.1\.mlp\.up_proj\.weight")


def test_missing_directory_and_config(tmp_path, target):
    refused(tmp_path / "nowhere", target, "does not exist")
    (tmp_path / "a-file").write_text("")
    refused(tmp_path / "a-file", target, "is a file, not a directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", target, "config.json")


# --- precision ------------------------------------------------------------------------------


def test_eight_bits_is_an_opt_in_that_proposes(drafter_dir, target):
    model, cfg = target
    full = propose_for(load_drafter(drafter_dir, model, cfg), random_taps([6, 2, 9]), [30, 40, 50])
    drafter = load_drafter(drafter_dir, model, cfg, bits=8)
    quantized = {p for p, m in drafter.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert {"fc", "layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "markov_head.markov_w2"} <= quantized
    assert "confidence_head.proj" not in quantized
    proposal = propose_for(drafter, random_taps([6, 2, 9]), [30, 40, 50])
    assert proposal.tokens.shape == (3, 4) and validate_proposal(proposal) == [None] * 3
    # 8-bit weights move the logits a little (row 0: later rows follow the picks, which may part).
    assert np.abs(np.array(proposal.logits)[:, 0] - np.array(full.logits)[:, 0]).max() < 1.0
    np.testing.assert_array_equal(np.array(proposal.tokens)[:, 0], np.array(full.tokens)[:, 0])


@pytest.mark.parametrize("bits", [4, 16])
def test_other_bit_widths_are_refused_by_name(drafter_dir, target, bits):
    model, cfg = target
    with pytest.raises(CheckpointError, match=f"bits {bits}"):
        load_drafter(drafter_dir, model, cfg, bits=bits)


# --- per-lane draft errors -------------------------------------------------------------------


def test_nan_in_one_lane_fails_only_that_lane(drafter_dir, target):
    model, cfg = target
    drafter = load_drafter(drafter_dir, model, cfg)
    taps = random_taps([5, 7, 4])
    taps[1] = mx.where(mx.arange(taps[1].shape[1]) == 3, float("nan"), taps[1])  # a poisoned context row
    proposal = propose_for(drafter, taps, [30, 40, 50])
    errors = drafter.validate(proposal)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], DraftError) and errors[1].lane == 1 and "NaN" in str(errors[1])
    assert np.isfinite(np.array(proposal.logits)[[0, 2]]).all()


def test_out_of_range_id_fails_only_that_lane(drafter_dir, target):
    model, cfg = target
    drafter = load_drafter(drafter_dir, model, cfg)

    def faulty(logits, k):  # lane 2 gets an id past the vocabulary at k=1, lane 0 a negative one at k=2
        ids = mx.argmax(logits, axis=-1)
        bad = mx.array([-5 if k == 2 else 0, 0, cfg.vocab_size if k == 1 else 0, 0])
        return mx.where(bad != 0, bad, ids)

    proposal = propose_for(drafter, random_taps([3, 4, 5, 6]), [30, 40, 50, 60], pick=faulty)
    errors = validate_proposal(proposal)
    assert errors[1] is None and errors[3] is None
    assert "outside [0, 512)" in str(errors[0]) and "outside [0, 512)" in str(errors[2])
    assert np.isfinite(np.array(proposal.logits)).all()

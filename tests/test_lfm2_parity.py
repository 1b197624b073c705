"""The MLX target against transformers' Lfm2ForCausalLM / Lfm2MoeForCausalLM on the same
tiny weights: an independent implementation of the same checkpoint.

Always: against the committed references in tests/references/ (checkpoints saved by
transformers, its greedy ids and logits; `python tests/make_references.py` rewrites them),
so the suite needs no torch. With torch installed, also live, on checkpoints written by
laneserve's tiny maker."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from families.lfm2 import Lfm2Target, load_model
from tests.make_references import REFERENCES, SHAPES, STEPS, prompt_for, reference_run

TOLERANCE = 1e-4


def assert_matches(path, prompt: list[int], greedy: list[int], expected: np.ndarray) -> None:
    """laneserve's logits for the whole prompt, then for a chunked prefill and one step per
    token of `greedy`, against `expected` (the reference's rows for prompt + greedy), and
    laneserve's own greedy choice at every step against the reference's."""
    model, config = load_model(path)
    whole, _ = model(mx.array([prompt]))
    assert np.abs(np.array(model.head(whole)[0]) - expected[: len(prompt)]).max() < TOLERANCE

    target = Lfm2Target(model, config, max_lanes=2)
    lane = target.open_lane()
    last, _ = target.prefill(lane, prompt, chunk=16)
    got = np.array(last)
    for step, token in enumerate(greedy):
        assert np.abs(got - expected[len(prompt) - 1 + step]).max() < TOLERANCE, f"step {step}"
        assert int(got.argmax()) == token, f"greedy id at step {step}"
        out = target.forward([lane], [[token]])
        target.commit(out, [1])
        got = np.array(out.logits[0])
    assert np.abs(got - expected[len(prompt) + len(greedy) - 1]).max() < TOLERANCE


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_matches_the_committed_transformers_reference(kind):
    folder = REFERENCES / kind
    reference = json.loads((folder / "reference.json").read_text())
    expected = np.load(folder / "logits.npy")
    assert len(reference["greedy"]) == STEPS and expected.shape == (len(reference["prompt"]) + STEPS, SHAPES[kind].vocab)
    assert_matches(folder, reference["prompt"], reference["greedy"], expected)


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_matches_transformers_live(checkpoint, request):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = Path(request.getfixturevalue(checkpoint))
    prompt = prompt_for(500)
    greedy, expected = reference_run(path, prompt, 32)
    assert_matches(path, prompt, greedy, expected)

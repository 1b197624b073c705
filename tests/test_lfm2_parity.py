"""The MLX target against transformers' Lfm2ForCausalLM / Lfm2MoeForCausalLM on the same
tiny weights: an independent implementation of the same checkpoint."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from families.lfm2 import Lfm2Target, load_model

TOLERANCE = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(0).integers(15, 500, 64)]
STEPS = 32


def reference_logits(path, tokens) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("checkpoint", ["dense_dir", "moe_dir"])
def test_prompt_and_incremental_steps_match_transformers(checkpoint, request):
    path = request.getfixturevalue(checkpoint)
    # The continuation is the reference's own greedy choices, so every step feeds a token
    # the target would really emit.
    tokens = list(PROMPT)
    for _ in range(STEPS):
        tokens.append(int(reference_logits(path, tokens)[-1].argmax()))
    expected = reference_logits(path, tokens)

    model, config = load_model(path)
    whole, _ = model(mx.array([PROMPT]))
    assert np.abs(np.array(model.head(whole)[0]) - expected[: len(PROMPT)]).max() < TOLERANCE

    target = Lfm2Target(model, config, max_lanes=2)
    lane = target.open_lane()
    last, _ = target.prefill(lane, PROMPT, chunk=24)
    assert np.abs(np.array(last) - expected[len(PROMPT) - 1]).max() < TOLERANCE
    for step in range(STEPS):
        out = target.forward([lane], [[tokens[len(PROMPT) + step]]])
        target.commit(out, [1])
        got = np.array(out.logits[0])
        assert np.abs(got - expected[len(PROMPT) + step]).max() < TOLERANCE, f"step {step}"

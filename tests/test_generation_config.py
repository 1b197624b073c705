"""Sampling defaults from a checkpoint's generation_config.json: flag > file > SamplingParams."""

from __future__ import annotations

import json
import shutil

import pytest

from daemon.cli import parser, sampling_params
from families.lfm2.config import CheckpointError, generation_defaults
from lanes.sampling import SamplingParams


def write_generation_config(path, **fields):
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, **fields}))
    return path


def parsed(model, *flags):
    args = parser().parse_args(["generate", "--model", str(model), "--prompt", "hi", *flags])
    return sampling_params(args)


def test_reads_only_the_sampling_keys_present(tmp_path):
    write_generation_config(tmp_path, temperature=0.3, min_p=0.15, top_k=None, do_sample=False)
    assert generation_defaults(tmp_path) == {"temperature": 0.3, "min_p": 0.15}


def test_no_file_means_no_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}


@pytest.mark.parametrize("key, value", [
    ("temperature", -0.5), ("temperature", "warm"), ("top_p", 0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("min_p", 1.0), ("repetition_penalty", 0), ("repetition_penalty", True),
])
def test_a_bad_value_is_refused_by_name(tmp_path, key, value):
    write_generation_config(tmp_path, **{key: value})
    with pytest.raises(CheckpointError, match=f"'{key}'"):
        generation_defaults(tmp_path)


def test_a_nan_is_refused_by_name(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": NaN}')
    with pytest.raises(CheckpointError, match="'temperature'"):
        generation_defaults(tmp_path)


def test_flags_override_the_file_which_overrides_sampling_defaults(tmp_path):
    write_generation_config(tmp_path, temperature=0.3, top_p=0.9, top_k=40, min_p=0.15, repetition_penalty=1.05)
    assert parsed(tmp_path) == SamplingParams(temperature=0.3, top_p=0.9, top_k=40, min_p=0.15, repetition_penalty=1.05)
    assert parsed(tmp_path, "--temperature", "0", "--top-k", "0", "--seed", "5") == SamplingParams(
        temperature=0.0, top_p=0.9, top_k=0, min_p=0.15, repetition_penalty=1.05, seed=5)


def test_without_a_file_generate_is_greedy(dense_dir, tmp_path):
    plain = shutil.copytree(dense_dir, tmp_path / "plain")
    (plain / "generation_config.json").unlink(missing_ok=True)
    assert parsed(plain) == SamplingParams()

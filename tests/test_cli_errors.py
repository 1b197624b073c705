"""Every bad input to the command line ends in one line, `laneserve: error: ...`, naming the
problem, and exit status 2: no traceback. Any other exception is a bug, reported as one
`laneserve: internal error` line with exit status 70, its traceback only under
--log-level DEBUG. Each case runs the real command line in-process (`daemon.cli.main`); one
runs it as a subprocess to show what a shell sees."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import families.lfm2.loader as loader
import families.lfm2.tiny as tiny
from daemon.cli import INTERNAL_ERROR, main
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from lanes.engine import Engine
from lanes.round import RoundRunner

# What Python makes of the argv bytes ff fe, which are not UTF-8 (surrogate escapes).
NOT_UTF8 = b"\xff\xfe".decode("utf-8", "surrogateescape")


def refused(argv, capsys, *named: str) -> str:
    """Run `laneserve argv`; it must exit 2 with one line naming every string in `named`."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("laneserve: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in named:
        assert name in lines[0], lines[0]
    return lines[0]


def reported_as_a_bug(argv, capsys, *named: str) -> str:
    """Run `laneserve argv`; it must exit INTERNAL_ERROR, its last line saying so and naming
    every string in `named`, never the user's `laneserve: error:`. Returns stderr."""
    assert main([str(a) for a in argv]) == INTERNAL_ERROR
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("laneserve: internal error (a bug in laneserve") and "laneserve: error:" not in err, err
    for name in named:
        assert name in last, last
    return err


def generated(argv, capsys) -> dict:
    assert main(["generate", "--json", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def plant(path, name, value):
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name].flat[7] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def dense_copy(dense_dir, tmp_path):
    return shutil.copytree(dense_dir, tmp_path / "dense")


# --- generate: the flags ---------------------------------------------------------------------


@pytest.mark.parametrize("ids", ["a,b", "1.5", "3,,x"])
def test_prompt_ids_that_are_not_integers(dense_dir, capsys, ids):
    refused(["generate", "--model", dense_dir, "--prompt-ids", ids], capsys, "--prompt-ids must be comma-separated integers", repr(ids))


@pytest.mark.parametrize("flag", ["--prompt", "--chat"])
def test_prompt_text_that_is_not_utf8(dense_dir, capsys, flag):
    refused(["generate", "--model", dense_dir, flag, NOT_UTF8], capsys, f"{flag} is not valid UTF-8", "byte 0xff")


def test_stop_string_that_is_not_utf8(dense_dir, capsys):
    refused(["generate", "--model", dense_dir, "--prompt", "hi", "--stop", "a" + NOT_UTF8], capsys, "--stop is not valid UTF-8")


@pytest.mark.parametrize("flag, value, named", [
    ("--temperature", "-1", "--temperature must be a finite number >= 0, got -1.0"),
    ("--top-p", "1.5", "--top-p must be in (0, 1], got 1.5"),
    ("--top-k", "-2", "--top-k must be >= 0"),
    ("--min-p", "1", "--min-p must be in [0, 1)"),
    ("--repetition-penalty", "0", "--repetition-penalty must be a finite number > 0"),
])
def test_sampling_flag_out_of_range(dense_dir, capsys, flag, value, named):
    refused(["generate", "--model", dense_dir, "--prompt", "hi", flag, value], capsys, named)


def test_prompt_ids_outside_the_vocabulary(dense_dir, capsys):
    refused(["generate", "--model", dense_dir, "--prompt-ids", "5,512,9"], capsys, "outside the vocabulary (0..511)", "[512]")


def test_prompt_past_the_context_limit(tmp_path, capsys):
    short = make_tiny_target(tmp_path / "short", "lfm2", seed=1, shape=TinyShape(max_position=16))
    ids = ",".join(str(i) for i in range(20, 40))
    refused(["generate", "--model", short, "--prompt-ids", ids, "--max-tokens", "4"], capsys,
            "maximum context length is 16 tokens", "the prompt has 20")


def test_unknown_log_level(dense_dir, capsys):
    refused(["--log-level", "BOGUS", "generate", "--model", dense_dir, "--prompt", "hi"], capsys, "--log-level 'BOGUS'")


def test_model_that_is_a_file(dense_dir, capsys):
    refused(["generate", "--model", dense_dir / "config.json", "--prompt", "hi"], capsys, "config.json is a file, not a directory")


def test_bad_generation_config_value(dense_copy, capsys):
    (dense_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "top_p": 1.5}))
    refused(["generate", "--model", dense_copy, "--prompt", "hi"], capsys, "generation_config.json 'top_p'")


def test_the_subprocess_sees_one_line_and_status_2(dense_dir):
    # Real argv bytes, decoded by the interpreter itself.
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "generate", "--model", str(dense_dir), "--prompt", b"\xff\xfe"],
        capture_output=True, text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "laneserve: error: --prompt is not valid UTF-8 (byte 0xff at character 0)"
    assert "Traceback" not in done.stderr


# --- generate: bugs, not the user's doing -----------------------------------------------------


@pytest.fixture
def loading_bug(monkeypatch):
    def broken(raw, cfg):
        raise ValueError("boom deep inside loading")

    monkeypatch.setattr(loader, "canonical_names", broken)


def test_an_internal_error_is_reported_as_a_bug_not_a_usage_error(dense_dir, capsys, loading_bug):
    err = reported_as_a_bug(["generate", "--model", dense_dir, "--prompt", "hi"], capsys,
                            "ValueError: boom deep inside loading", "rerun with --log-level DEBUG")
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_its_traceback_shows_under_log_level_debug(dense_dir, capsys, loading_bug):
    err = reported_as_a_bug(["--log-level", "DEBUG", "generate", "--model", dense_dir, "--prompt", "hi"], capsys,
                            "ValueError: boom deep inside loading")
    assert "Traceback" in err and "in broken" in err, err


def test_an_engine_fault_is_reported_as_a_bug(dense_dir, capsys, monkeypatch):
    def broken(self, lanes, chunks):
        raise RuntimeError("boom in the engine thread")

    monkeypatch.setattr(RoundRunner, "prefill", broken)
    reported_as_a_bug(["generate", "--model", dense_dir, "--prompt", "hi"], capsys,
                      "the engine failed the request", "RuntimeError: boom in the engine thread")


# As MLX's allocators word it on CUDA, Metal and the CPU.
OUT_OF_MEMORY = ["cudaMallocAsync(&data, size, stream) failed: out of memory",
                 "[METAL] Command buffer execution failed: Insufficient Memory",
                 "[malloc_or_wait] Unable to allocate 4294967296 bytes."]


@pytest.mark.parametrize("message", OUT_OF_MEMORY)
def test_running_out_of_memory_while_loading_is_not_reported_as_a_bug(dense_dir, capsys, monkeypatch, message):
    def exhausted(raw, cfg):
        raise RuntimeError(message)

    monkeypatch.setattr(loader, "canonical_names", exhausted)
    refused(["generate", "--model", dense_dir, "--prompt", "hi"], capsys, "out of memory", message, "--dtype")


def test_running_out_of_memory_in_the_engine_is_not_reported_as_a_bug(dense_dir, capsys, monkeypatch):
    def exhausted(self, lanes, chunks):
        raise RuntimeError(OUT_OF_MEMORY[0])

    monkeypatch.setattr(RoundRunner, "prefill", exhausted)
    refused(["generate", "--model", dense_dir, "--prompt", "hi"], capsys, "out of memory", OUT_OF_MEMORY[0])


def test_a_server_whose_warm_up_runs_out_of_memory_says_so_and_exits_2(dense_dir, drafter_dir, caplog, monkeypatch):
    def exhausted(self):
        raise RuntimeError(OUT_OF_MEMORY[0])

    monkeypatch.setattr(Engine, "warm_up", exhausted)
    assert main(["serve", "--model", str(dense_dir), "--draft-model", str(drafter_dir), "--port", "0"]) == 2
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("ran out of memory while warming up" in line and "--max-streams" in line for line in said), said


def test_a_server_whose_warm_up_fails_otherwise_reports_a_bug(dense_dir, drafter_dir, caplog, monkeypatch):
    def broken(self):
        raise RuntimeError("boom while warming up")

    monkeypatch.setattr(Engine, "warm_up", broken)
    assert main(["serve", "--model", str(dense_dir), "--draft-model", str(drafter_dir), "--port", "0"]) == INTERNAL_ERROR
    assert any("stopped while warming up: RuntimeError: boom" in r.getMessage() for r in caplog.records)


# --- generate: the checkpoints ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_moe_in_half_precision_runs_on_the_cpu(moe_dir, capsys, dtype):
    # MLX's CPU gather_mm is float32 only: the experts stay float32, the rest runs in `dtype`.
    out = generated(["--model", moe_dir, "--prompt-ids", "20,30,40", "--max-tokens", "6", "--dtype", dtype], capsys)
    assert len(out["token_ids"]) == 6 and out["finish_reason"] == "length"


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_target_weight(dense_copy, capsys, value):
    plant(dense_copy, "model.layers.3.feed_forward.w2.weight", value)
    refused(["generate", "--model", dense_copy, "--prompt", "hi"], capsys, "tensor model.layers.3.feed_forward.w2.weight holds NaN or infinite values")


@pytest.fixture
def drafter_copy(dense_dir, tmp_path):
    return make_tiny_drafter(tmp_path / "drafter", dense_dir, seed=3)


def test_non_finite_drafter_weight(dense_dir, drafter_copy, capsys):
    plant(drafter_copy, "layers.0.self_attn.q_proj.weight", np.nan)
    refused(["generate", "--model", dense_dir, "--draft-model", drafter_copy, "--prompt", "hi"], capsys,
            "drafter tensor layers.0.self_attn.q_proj.weight holds NaN or infinite values")


@pytest.mark.parametrize("block_size", [32, 100_000])
def test_drafter_block_size_past_the_verify_ceiling(dense_dir, drafter_copy, capsys, block_size):
    config = json.loads((drafter_copy / "config.json").read_text())
    config["block_size"] = block_size
    (drafter_copy / "config.json").write_text(json.dumps(config))
    refused(["generate", "--model", dense_dir, "--draft-model", drafter_copy, "--prompt", "hi"], capsys,
            "'block_size' must be an integer in 1..31", str(block_size))


# --- make-tiny ---------------------------------------------------------------------------------


def test_make_tiny_out_is_an_existing_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("mine")
    refused(["make-tiny", "--kind", "lfm2", "--out", tmp_path / "taken"], capsys, "is a file, not a directory")
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("flags, named", [
    (["--hidden", "65"], "hidden_size 65 is not a multiple of num_attention_heads 4"),
    (["--layers", "0"], "'num_hidden_layers' must be an integer >= 1"),
    (["--heads", "0"], "'num_attention_heads' must be an integer >= 1"),
    (["--kv-heads", "3"], "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (["--hidden", "12"], "hidden_size / num_attention_heads = 3 is odd"),
    (["--rope-theta", "-1"], "'rope_theta' must be a finite positive number"),
    (["--rope-theta", "0"], "'rope_theta' must be a finite positive number"),
    (["--rope-theta", "nan"], "'rope_theta' must be a finite positive number"),
    (["--rope-theta", "inf"], "'rope_theta' must be a finite positive number"),
    (["--vocab", "100"], "vocab must be at least 271"),
    (["--max-position", "0"], "'max_position_embeddings' must be an integer >= 1"),
    (["--ffn", "0"], "FFN widths must be >= 1"),
    (["--kind", "lfm2_moe", "--experts-per-token", "9"], "num_experts_per_tok 9 exceeds num_experts 8"),
    (["--kind", "lfm2_moe", "--experts", "0"], "'num_experts' must be an integer >= 1"),
    (["--kind", "lfm2_moe", "--expert-ffn", "-4"], "FFN widths must be >= 1"),
])
def test_make_tiny_refuses_a_shape_before_writing_anything(tmp_path, capsys, flags, named):
    kind = [] if "--kind" in flags else ["--kind", "lfm2"]
    refused(["make-tiny", *kind, *flags, "--out", tmp_path / "out"], capsys, named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, named", [
    (["--block-size", "32"], "'block_size' must be an integer in 1..31"),
    (["--head-dim", "15"], "'head_dim' 15 is odd"),
    (["--heads", "3"], "num_attention_heads 3 is not a multiple of num_key_value_heads 2"),
    (["--rank", "0"], "'markov_rank'"),
    (["--taps", "2,2"], "'target_layer_ids' must be strictly increasing"),
    (["--taps", "1,5"], "'target_layer_ids' [1, 5] must lie in 0..4"),
    (["--taps", "a"], "--taps must be comma-separated integers"),
    (["--rope-theta", "nan"], "'rope_theta' must be a finite positive number"),
])
def test_make_tiny_refuses_a_drafter_before_writing_anything(dense_dir, tmp_path, capsys, flags, named):
    refused(["make-tiny", "--kind", "dspark", "--target", dense_dir, *flags, "--out", tmp_path / "out"], capsys, named)
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_leaves_no_partial_directory_when_writing_fails(tmp_path, capsys, monkeypatch):
    def disk_full(folder, vocab):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny, "write_tokenizer", disk_full)
    refused(["make-tiny", "--kind", "lfm2", "--out", tmp_path / "out"], capsys, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_make_tiny_writes_a_checkpoint_generate_reads(tmp_path, capsys):
    assert main(["make-tiny", "--kind", "lfm2", "--out", str(tmp_path / "out"), "--layers", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    out = generated(["--model", tmp_path / "out", "--prompt", "hi", "--max-tokens", "3"], capsys)
    assert len(out["token_ids"]) == 3

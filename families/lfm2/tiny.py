"""Tiny random LFM2 checkpoints in the real on-disk format, for tests and benchmarks.

`make_tiny_target` writes what a Hugging Face LFM2 / LFM2-MoE directory holds:
config.json, generation_config.json, model.safetensors with HF tensor names and layouts,
tokenizer.json (a byte-level BPE with LFM2's special tokens) and tokenizer_config.json
with a ChatML chat template. The same seed gives the same files. The final norm is
scaled up so logits are peaked: greedy choices have clear margins and are not decided
by float noise.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .bpe import BOS, IM_END, PAD, EOS_TEXT, SPECIAL_TOKENS, save_tokenizer, train_bpe
from .config import CheckpointError, Lfm2Config

# Text the tiny tokenizer learns its merges from (fixed, so every machine builds the same one).
TOKENIZER_TEXT = [
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Readability counts. Errors should never pass "
    "silently, unless explicitly silenced. In the face of ambiguity, refuse the temptation to guess.",
    "The quick brown fox jumps over the lazy dog. A lane is one stream of tokens; a round "
    "serves every lane at once. The drafter proposes, the target verifies, and every token "
    "is exactly what the target alone would emit.",
    "In the beginning was the word, and the word was a token. Numbers: 0 1 2 3 4 5 6 7 8 9 10 "
    "100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } ' \" - + * / = < >.",
    "def generate(model, prompt, max_tokens=16):\n    return model(prompt)\n",
]


@dataclass(frozen=True)
class TinyShape:
    vocab: int = 512
    hidden: int = 64
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    experts: int = 8
    experts_per_token: int = 2
    expert_ffn: int = 32
    dense_layers: int = 2
    rope_theta: float = 1e6
    max_position: int = 4096
    conv_kernel: int = 3
    final_norm_scale: float = 1.5
    attention: tuple[int, ...] | None = None  # attention layer indices; default every third from 2

    def layer_types(self) -> list[str]:
        attention = self.attention if self.attention is not None else range(2, self.layers, 3)
        return ["full_attention" if i in attention else "conv" for i in range(self.layers)]


def _dense(rng: np.random.Generator, rows: int, cols: int, dtype) -> np.ndarray:
    return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype)


def _norm(rng: np.random.Generator, size: int, dtype, scale: float = 1.0) -> np.ndarray:
    return (scale * (1.0 + 0.1 * rng.standard_normal(size))).astype(dtype)


def target_config(kind: str, shape: TinyShape, dtype: str) -> dict:
    config = {
        "architectures": ["Lfm2MoeForCausalLM" if kind == "lfm2_moe" else "Lfm2ForCausalLM"],
        "model_type": kind,
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_position,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": shape.conv_kernel,
        "layer_types": shape.layer_types(),
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": True,
        "bos_token_id": BOS,
        "eos_token_id": IM_END,
        "pad_token_id": PAD,
        "torch_dtype": dtype,
        "dtype": dtype,
        "intermediate_size": shape.ffn,
        "block_ff_dim": shape.ffn,
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 1,
        "block_ffn_dim_multiplier": 1.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if kind == "lfm2_moe":
        config.update(
            num_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.expert_ffn,
            num_dense_layers=shape.dense_layers,
            norm_topk_prob=True,
            use_expert_bias=True,
            routed_scaling_factor=1.0,
        )
    return config


def target_tensors(kind: str, shape: TinyShape, seed: int, dtype=np.float32, expert_layout: str = "per-expert") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": (rng.standard_normal((shape.vocab, h)) * 0.4).astype(dtype),
        "model.embedding_norm.weight": _norm(rng, h, dtype, shape.final_norm_scale),
    }
    for i, kind_i in enumerate(shape.layer_types()):
        p = f"model.layers.{i}."
        t[p + "operator_norm.weight"] = _norm(rng, h, dtype)
        t[p + "ffn_norm.weight"] = _norm(rng, h, dtype)
        if kind_i == "conv":
            t[p + "conv.in_proj.weight"] = _dense(rng, 3 * h, h, dtype)
            t[p + "conv.conv.weight"] = (rng.standard_normal((h, 1, shape.conv_kernel)) * 0.5).astype(dtype)
            t[p + "conv.out_proj.weight"] = _dense(rng, h, h, dtype)
        else:
            t[p + "self_attn.q_proj.weight"] = _dense(rng, shape.heads * head_dim, h, dtype)
            t[p + "self_attn.k_proj.weight"] = _dense(rng, shape.kv_heads * head_dim, h, dtype)
            t[p + "self_attn.v_proj.weight"] = _dense(rng, shape.kv_heads * head_dim, h, dtype)
            t[p + "self_attn.out_proj.weight"] = _dense(rng, h, shape.heads * head_dim, dtype)
            t[p + "self_attn.q_layernorm.weight"] = _norm(rng, head_dim, dtype)
            t[p + "self_attn.k_layernorm.weight"] = _norm(rng, head_dim, dtype)
        f = p + "feed_forward."
        if kind == "lfm2_moe" and i >= shape.dense_layers:
            e, w = shape.experts, shape.expert_ffn
            t[f + "gate.weight"] = _dense(rng, e, h, dtype)
            t[f + "expert_bias"] = (0.1 * rng.standard_normal(e)).astype(np.float32)
            w1 = np.stack([_dense(rng, w, h, dtype) for _ in range(e)])
            w3 = np.stack([_dense(rng, w, h, dtype) for _ in range(e)])
            w2 = np.stack([_dense(rng, h, w, dtype) for _ in range(e)])
            if expert_layout == "fused":  # transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]
                t[f + "experts.gate_up_proj"] = np.concatenate([w1, w3], axis=1)
                t[f + "experts.down_proj"] = w2
            else:
                for j in range(e):
                    t[f + f"experts.{j}.w1.weight"] = w1[j]
                    t[f + f"experts.{j}.w3.weight"] = w3[j]
                    t[f + f"experts.{j}.w2.weight"] = w2[j]
        else:
            t[f + "w1.weight"] = _dense(rng, shape.ffn, h, dtype)
            t[f + "w3.weight"] = _dense(rng, shape.ffn, h, dtype)
            t[f + "w2.weight"] = _dense(rng, h, shape.ffn, dtype)
    return t


def write_tokenizer(out: Path, vocab: int) -> None:
    save_tokenizer(train_bpe(TOKENIZER_TEXT, vocab), out)


def save_tensors(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "bfloat16":  # numpy has no bfloat16: write through MLX
        import mlx.core as mx

        mx.save_safetensors(str(path), {k: mx.array(v).astype(mx.bfloat16) if k.split(".")[-1] != "expert_bias" else mx.array(v) for k, v in tensors.items()}, metadata={"format": "pt"})
    else:
        save_file(tensors, str(path), metadata={"format": "pt"})


def checked_target_config(kind: str, shape: TinyShape, dtype: str) -> dict:
    """The config.json `shape` would write, refused (CheckpointError naming the field) where
    laneserve would refuse to load it or the tiny maker cannot build it."""
    config = target_config(kind, shape, dtype)
    try:
        Lfm2Config.from_dict(config)
    except CheckpointError as e:
        raise CheckpointError(f"refusing to write a checkpoint laneserve cannot load: {e}") from None
    if shape.vocab < len(SPECIAL_TOKENS) + 256:
        raise CheckpointError(f"vocab must be at least {len(SPECIAL_TOKENS) + 256} (special tokens + 256 bytes), got {shape.vocab}")
    widths = {"ffn": shape.ffn} if kind == "lfm2" or shape.dense_layers > 0 else {}
    if kind == "lfm2_moe":
        widths["expert_ffn"] = shape.expert_ffn
    bad = {name: width for name, width in widths.items() if width < 1}
    if bad:
        raise CheckpointError(f"FFN widths must be >= 1, got {bad}")
    return config


def write_checkpoint(out: str | Path, write: Callable[[Path], None]) -> Path:
    """Run `write(folder)` in a staging folder beside `out`, then move its files into
    `out`: a failure midway leaves no partial checkpoint behind."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output path {out} is a file, not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(staging)
        out.mkdir(exist_ok=True)
        for file in staging.iterdir():
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def make_tiny_target(
    out: str | Path,
    kind: str = "lfm2",
    seed: int = 0,
    shape: TinyShape = TinyShape(),
    dtype: str = "float32",
    expert_layout: str = "per-expert",
) -> Path:
    if kind not in ("lfm2", "lfm2_moe"):
        raise ValueError(f"unknown tiny kind {kind!r}; choose lfm2 or lfm2_moe")
    if expert_layout not in ("per-expert", "fused"):
        raise ValueError(f"unknown expert layout {expert_layout!r}; choose per-expert or fused")
    config = checked_target_config(kind, shape, dtype)

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "generation_config.json").write_text(
            json.dumps({"bos_token_id": BOS, "eos_token_id": [IM_END, EOS_TEXT], "pad_token_id": PAD}, indent=2) + "\n"
        )
        np_dtype = np.float16 if dtype == "float16" else np.float32
        save_tensors(target_tensors(kind, shape, seed, np_dtype, expert_layout), folder / "model.safetensors", dtype)
        write_tokenizer(folder, shape.vocab)

    return write_checkpoint(out, write)

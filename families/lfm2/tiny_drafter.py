"""Tiny random DSpark drafters in LiquidAI's on-disk format, for tests and benchmarks.

`make_tiny_drafter` writes what a LiquidAI drafter directory holds for a given target
directory: config.json (architectures ["Lfm2DSparkDraftModel"], model_type "qwen3", the
pairing fields inside `dflash_config` as published, or at top level on request) and
model.safetensors. The same seed gives the same files. The final norm is scaled up so
the borrowed head gives peaked logits: greedy chains have clear margins.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import CheckpointError, Lfm2Config
from .drafter import DSparkConfig, check_pairing
from .tiny import _dense, _norm, save_tensors, write_checkpoint
from .tokenizer import ChatTokenizer

MASK_TOKEN = "<|mask|>"


def default_taps(target_layers: int, count: int = 3) -> list[int]:
    """`count` tap layers spread from layer 0 to the one before the last."""
    return sorted({round(i * (target_layers - 2) / max(count - 1, 1)) for i in range(count)})


def drafter_tensors(config: dict, target_hidden: int, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights for a drafter config.json (as `make_tiny_drafter` writes it)."""
    rng = np.random.default_rng(seed)
    h, v, r = config["hidden_size"], config["vocab_size"], config["markov_rank"]
    heads, kv_heads, d, f = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]
    taps = len((config.get("dflash_config") or config)["target_layer_ids"])
    t = {
        "fc.weight": _dense(rng, h, taps * target_hidden, dtype),
        "hidden_norm.weight": _norm(rng, h, dtype),
        "norm.weight": _norm(rng, h, dtype, 2.5),
    }
    # Layer outputs are scaled up so the block's layers, not the borrowed embedding of
    # the mask token riding the residual, decide what the mask rows propose.
    write = 3.0
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = _norm(rng, h, dtype)
        t[p + "post_attention_layernorm.weight"] = _norm(rng, h, dtype)
        t[p + "self_attn.q_proj.weight"] = _dense(rng, heads * d, h, dtype)
        t[p + "self_attn.k_proj.weight"] = _dense(rng, kv_heads * d, h, dtype)
        t[p + "self_attn.v_proj.weight"] = _dense(rng, kv_heads * d, h, dtype)
        t[p + "self_attn.o_proj.weight"] = write * _dense(rng, h, heads * d, dtype)
        t[p + "self_attn.q_norm.weight"] = _norm(rng, d, dtype)
        t[p + "self_attn.k_norm.weight"] = _norm(rng, d, dtype)
        t[p + "mlp.gate_proj.weight"] = _dense(rng, f, h, dtype)
        t[p + "mlp.up_proj.weight"] = _dense(rng, f, h, dtype)
        t[p + "mlp.down_proj.weight"] = write * _dense(rng, h, f, dtype)
    # Markov logits of a few units: enough to move the chain, not to drown the base logits.
    t["markov_head.markov_w1.weight"] = rng.standard_normal((v, r)).astype(dtype)
    t["markov_head.markov_w2.weight"] = (2.0 * rng.standard_normal((v, r)) / np.sqrt(r)).astype(dtype)
    if config["enable_confidence_head"]:
        width = h + (r if config.get("confidence_head_with_markov", True) else 0)
        t["confidence_head.proj.weight"] = _dense(rng, 1, width, dtype)
        t["confidence_head.proj.bias"] = np.array([0.5], dtype=dtype)
    return t


def make_tiny_drafter(
    out: str | Path,
    target_dir: str | Path,
    seed: int = 0,
    layers: int = 2,
    block_size: int = 4,
    taps: list[int] | None = None,
    rank: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    rope_theta: float = 1e4,
    confidence: bool = True,
    confidence_with_markov: bool = True,
    nested: bool = True,
    dtype: str = "float32",
) -> Path:
    """Write a random drafter for the target at `target_dir`; returns `out`.

    `taps` defaults to three layers spread below the target's last; `nested=False`
    writes the pairing fields at top level instead of inside `dflash_config`."""
    target_dir, out = Path(target_dir), Path(out)
    target = Lfm2Config.from_dir(target_dir)
    mask = ChatTokenizer(target_dir).token_to_id(MASK_TOKEN)
    if mask is None:
        raise CheckpointError(f"the target tokenizer at {target_dir} has no {MASK_TOKEN} token")
    pairing = {
        "mask_token_id": mask,
        "target_layer_ids": default_taps(target.num_layers) if taps is None else list(taps),
        "num_target_layers": target.num_layers,
    }
    config = {
        "architectures": ["Lfm2DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": target.vocab_size,
        "rope_theta": rope_theta,
        "max_position_embeddings": target.max_position,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": block_size,
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": confidence,
        "rope_is_neox_style": False,
    }
    if not confidence_with_markov:  # an optional key, written only where it departs from the default
        config["confidence_head_with_markov"] = False
    if nested:
        config["dflash_config"] = pairing
    else:
        config.update(pairing)
    try:  # refuse, before writing anything, what load_drafter would refuse for this target
        check_pairing(DSparkConfig.from_dict(config), target)
    except CheckpointError as e:
        raise CheckpointError(f"refusing to write a drafter laneserve cannot load: {e}") from None

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        np_dtype = np.float16 if dtype == "float16" else np.float32
        save_tensors(drafter_tensors(config, target.hidden_size, seed, np_dtype), folder / "model.safetensors", dtype)

    return write_checkpoint(out, write)

"""A DSpark drafter's config.json (fields at top level or in `dflash_config`) and its
pairing with a target: every refusal names the field."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..config import CheckpointError, Lfm2Config, bool_field, int_field, positive_float_field, read_json, required, rope_theta_of

MAX_VERIFY_WIDTH = 32  # rows of one lane's verify window: the anchor plus at most 31 drafts
MAX_MARKOV_RANK = 1024  # the released heads use 256; wider tables are refused, not guessed at
SOURCE = "drafter config.json"
_int = partial(int_field, source=SOURCE)


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    rope_traditional: bool  # interleaved pairing (`rope_is_neox_style` false)
    block_size: int  # trained proposals per round, at most MAX_VERIFY_WIDTH - 1
    width: int  # proposals per round at runtime: runtime_block_size or block_size
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int
    enable_confidence_head: bool
    confidence_head_with_markov: bool

    @property
    def max_width(self) -> int:
        """The widest block `propose` accepts: the trained width (under the verify ceiling)."""
        return self.block_size

    @classmethod
    def from_dict(cls, raw: dict) -> DSparkConfig:
        """Read a drafter config; fields may sit at top level or inside `dflash_config`
        (the nested value wins). Every refusal names its field."""
        nested = raw.get("dflash_config") or {}
        if not isinstance(nested, dict):
            raise CheckpointError(f"{SOURCE} 'dflash_config' must be an object, got {nested!r}")
        raw = {**raw, **nested}
        hidden = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        kv_heads = _int(raw, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise CheckpointError(f"{SOURCE} num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        vocab = _int(raw, "vocab_size")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{SOURCE} 'hidden_act' must be 'silu' (SwiGLU), got {raw['hidden_act']!r}")
        if raw.get("attention_bias", False):
            raise CheckpointError(f"{SOURCE} 'attention_bias' is true; DSpark drafters have no attention biases")
        # Required (nested form first, as for the target): the published drafters differ
        # (1e6, 5e6, 1e7) and a wrong theta degrades with position instead of failing.
        theta = rope_theta_of(raw, default=None, source=SOURCE)
        mask = _int(raw, "mask_token_id", minimum=0)
        if mask >= vocab:
            raise CheckpointError(f"{SOURCE} 'mask_token_id' {mask} is not below vocab_size {vocab}")
        target_layers = _int(raw, "num_target_layers", minimum=2)
        ids = required(raw, "target_layer_ids", source=SOURCE)
        if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise CheckpointError(f"{SOURCE} 'target_layer_ids' must be a non-empty list of layer indices, got {ids!r}")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise CheckpointError(f"{SOURCE} 'target_layer_ids' must be strictly increasing, got {ids}")
        if ids[0] < 0 or ids[-1] >= target_layers - 1:
            # The last layer's residual is what the target's head reads; taps come before it.
            raise CheckpointError(
                f"{SOURCE} 'target_layer_ids' {ids} must lie in 0..{target_layers - 2} "
                f"(inside the {target_layers}-layer target, not its last layer)"
            )
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise CheckpointError(f"{SOURCE} 'markov_head_type' {raw['markov_head_type']!r} is not supported; expected 'vanilla'")
        # A verify window is the anchor plus the drafts, at most MAX_VERIFY_WIDTH rows: a wider
        # trained block is a wrong file, not something to narrow silently.
        block = _int(raw, "block_size", maximum=MAX_VERIFY_WIDTH - 1)
        width = block if raw.get("runtime_block_size") is None else _int(raw, "runtime_block_size", maximum=block)
        head_dim = _int(raw, "head_dim", hidden // heads)
        if head_dim % 2:
            raise CheckpointError(f"{SOURCE} 'head_dim' {head_dim} is odd; RoPE rotates pairs")
        return cls(
            hidden_size=hidden,
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(raw, "intermediate_size"),
            rms_norm_eps=positive_float_field(raw, "rms_norm_eps", 1e-6, SOURCE),
            vocab_size=vocab,
            rope_theta=theta,
            rope_traditional=not bool_field(raw, "rope_is_neox_style", False, SOURCE),
            block_size=block,
            width=width,
            mask_token_id=mask,
            target_layer_ids=tuple(ids),
            num_target_layers=target_layers,
            markov_rank=_int(raw, "markov_rank", maximum=MAX_MARKOV_RANK),
            enable_confidence_head=bool_field(raw, "enable_confidence_head", True, SOURCE),
            confidence_head_with_markov=bool_field(raw, "confidence_head_with_markov", True, SOURCE),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> DSparkConfig:
        return cls.from_dict(read_json(Path(path) / "config.json"))


def check_pairing(drafter: DSparkConfig, target: Lfm2Config) -> None:
    """Refuse a drafter trained for another target: its taps, embedding and head must fit."""
    if drafter.num_target_layers != target.num_layers:
        raise CheckpointError(
            f"drafter 'num_target_layers' {drafter.num_target_layers} does not match the target's {target.num_layers} layers"
        )
    if drafter.vocab_size != target.vocab_size:
        raise CheckpointError(f"drafter 'vocab_size' {drafter.vocab_size} does not match the target's {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        # The block is embedded with, and read out by, the target's table [V, H_target].
        raise CheckpointError(f"drafter 'hidden_size' {drafter.hidden_size} does not match the target's {target.hidden_size}")

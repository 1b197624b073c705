"""Reading LFM2 / LFM2-MoE config.json files.

Every field is read from the checkpoint; defaults apply only where the released files
omit a key. A file that contradicts itself or the architecture is refused with a
`CheckpointError` that names the field, never a traceback from deep inside a model.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that laneserve cannot serve; the message names the problem."""


MODEL_TYPES = ("lfm2", "lfm2_moe")
LAYER_KINDS = ("conv", "full_attention")
DEFAULT_ROPE_THETA = 1e6


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


# Field readers shared by the target's and the drafter's configs: each refusal names the
# file (`source`) and the field.


def required(raw: dict, key: str, default: Any = None, source: str = "config.json") -> Any:
    value = raw.get(key, default)
    if value is None:
        raise CheckpointError(f"{source} lacks '{key}'")
    return value


def int_field(raw: dict, key: str, default: int | None = None, minimum: int = 1, maximum: int | None = None,
              source: str = "config.json") -> int:
    value = required(raw, key, default, source)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise CheckpointError(f"{source} '{key}' must be an integer {bound}, got {value!r}")
    return value


def bool_field(raw: dict, key: str, default: bool, source: str = "config.json") -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{source} '{key}' must be true or false, got {value!r}")
    return value


def positive_float(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def positive_float_field(raw: dict, key: str, default: float, source: str = "config.json") -> float:
    value = raw.get(key, default)
    if not positive_float(value):
        raise CheckpointError(f"{source} '{key}' must be a finite positive number, got {value!r}")
    return float(value)


def rope_theta_of(raw: dict, default: float | None = DEFAULT_ROPE_THETA, source: str = "config.json") -> float:
    """`rope_parameters.rope_theta` wins over a top-level `rope_theta` (LFM2.5 files carry
    their real theta only in the nested form); `default` when neither is present (None:
    required)."""
    nested = raw.get("rope_parameters") or {}
    theta = nested.get("rope_theta", raw.get("rope_theta", default))
    if theta is None:
        raise CheckpointError(f"{source} lacks 'rope_theta'")
    if not positive_float(theta):
        raise CheckpointError(f"{source} 'rope_theta' must be a finite positive number, got {theta!r}")
    return float(theta)


def layer_kinds_of(raw: dict, num_layers: int) -> tuple[str, ...]:
    """Per-layer operator kinds from `layer_types`, or from the older `full_attn_idxs`."""
    if raw.get("layer_types") is not None:
        kinds = raw["layer_types"]
        if not isinstance(kinds, list) or len(kinds) != num_layers:
            raise CheckpointError(
                f"config.json 'layer_types' must list {num_layers} layer kinds, got {kinds!r}"
            )
        bad = sorted({k for k in kinds if k not in LAYER_KINDS}, key=str)
        if bad:
            raise CheckpointError(f"config.json 'layer_types' has unknown layer kinds {bad}; expected {LAYER_KINDS}")
        return tuple(kinds)
    idxs = raw.get("full_attn_idxs")
    if idxs is None:
        raise CheckpointError("config.json has neither 'layer_types' nor 'full_attn_idxs'")
    if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs):
        raise CheckpointError(f"config.json 'full_attn_idxs' must be a list of layer indices, got {idxs!r}")
    outside = [i for i in idxs if not 0 <= i < num_layers]
    if outside:
        raise CheckpointError(f"config.json 'full_attn_idxs' has indices outside 0..{num_layers - 1}: {outside}")
    return tuple("full_attention" if i in idxs else "conv" for i in range(num_layers))


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


@dataclass(frozen=True)
class Lfm2Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    layer_kinds: tuple[str, ...]
    conv_kernel: int
    conv_bias: bool
    norm_eps: float
    rope_theta: float
    max_position: int
    eos_ids: tuple[int, ...]
    bos_id: int | None
    pad_id: int | None
    # MoE (lfm2_moe only)
    num_experts: int = 0
    experts_per_token: int = 0
    num_dense_layers: int = 0
    norm_topk_prob: bool = True
    use_expert_bias: bool = False
    routed_scaling_factor: float = 1.0
    # MLX quantization block ({"group_size", "bits", per-layer overrides}) when present
    quantization: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.model_type == "lfm2_moe"

    # Cached: read several times for every layer of every forward (host time on the hot path).
    @functools.cached_property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "full_attention")

    @functools.cached_property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "conv")

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.num_dense_layers

    @classmethod
    def from_dict(cls, raw: dict) -> Lfm2Config:
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"config.json model_type {model_type!r} is not one of {MODEL_TYPES}")
        hidden = int_field(raw, "hidden_size")
        layers = int_field(raw, "num_hidden_layers")
        heads = int_field(raw, "num_attention_heads")
        kv_heads = int_field(raw, "num_key_value_heads", heads)
        if hidden % heads:
            raise CheckpointError(f"config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        if heads % kv_heads:
            raise CheckpointError(f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if (hidden // heads) % 2:
            raise CheckpointError(f"config.json hidden_size / num_attention_heads = {hidden // heads} is odd; RoPE rotates pairs")
        moe: dict[str, Any] = {}
        if model_type == "lfm2_moe":
            experts = int_field(raw, "num_experts")
            top_k = int_field(raw, "num_experts_per_tok")
            if top_k > experts:
                raise CheckpointError(f"config.json num_experts_per_tok {top_k} exceeds num_experts {experts}")
            moe = dict(
                num_experts=experts,
                experts_per_token=top_k,
                num_dense_layers=int_field(raw, "num_dense_layers", 0, minimum=0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                use_expert_bias=bool(raw.get("use_expert_bias", True)),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0) or 1.0),
            )
        return cls(
            model_type=model_type,
            vocab_size=int_field(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            layer_kinds=layer_kinds_of(raw, layers),
            conv_kernel=int_field(raw, "conv_L_cache", 3, minimum=2),
            conv_bias=bool(raw.get("conv_bias", False)),
            norm_eps=positive_float_field(raw, "norm_eps", 1e-5),
            rope_theta=rope_theta_of(raw),
            max_position=int_field(raw, "max_position_embeddings", 128_000),
            eos_ids=tuple(_id_list(raw.get("eos_token_id"))),
            bos_id=raw.get("bos_token_id"),
            pad_id=raw.get("pad_token_id"),
            quantization=raw.get("quantization") or raw.get("quantization_config"),
            **moe,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Lfm2Config:
        return cls.from_dict(read_json(Path(path) / "config.json"))


def _sampling_value(key: str, value: Any) -> float | int:
    """One sampling field of generation_config.json, checked against the range the
    sampler accepts (the same ranges as lanes.sampling.SamplingParams)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if key == "top_k":
        ok, want = number and value == int(value) and value >= 0, "an integer >= 0 (0 disables it)"
        value = int(value) if ok else value
    elif not number or not math.isfinite(value):
        ok, want = False, "a finite number"
    elif key == "temperature":
        ok, want = value >= 0, "a finite number >= 0"
    elif key == "top_p":
        ok, want = 0 < value <= 1, "in (0, 1]"
    elif key == "min_p":
        ok, want = 0 <= value < 1, "in [0, 1)"
    else:  # repetition_penalty
        ok, want = value > 0, "a finite number > 0"
    if not ok:
        raise CheckpointError(f"generation_config.json '{key}' must be {want}, got {value!r}")
    return value if key == "top_k" else float(value)


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: str | Path) -> dict[str, float | int]:
    """The checkpoint's recommended sampling settings: those of `SAMPLING_KEYS` that
    generation_config.json sets (null counts as unset), checked, keyed as
    `SamplingParams` fields. Callers let flags and request fields override them. As in
    vLLM, `do_sample` is not read: transformers' own default for it is false, which would
    turn every checkpoint's recommended temperature into greedy."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    raw = read_json(file)
    return {key: _sampling_value(key, raw[key]) for key in SAMPLING_KEYS if raw.get(key) is not None}


def eos_ids_of(path: str | Path, config: Lfm2Config, token_to_id) -> tuple[int, ...]:
    """The union of eos ids from config.json, generation_config.json and
    tokenizer_config.json (its `eos_token` is a string; `token_to_id` maps it)."""
    path = Path(path)
    ids = list(config.eos_ids)
    if (path / "generation_config.json").exists():
        ids += _id_list(read_json(path / "generation_config.json").get("eos_token_id"))
    if (path / "tokenizer_config.json").exists():
        token = read_json(path / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):  # AddedToken serialisation
            token = token.get("content")
        if isinstance(token, str) and token_to_id(token) is not None:
            ids.append(token_to_id(token))
    return tuple(dict.fromkeys(ids))

"""Loading LFM2 / LFM2-MoE checkpoint directories into MLX.

Tensors are read lazily from safetensors and materialised one layer at a time, so the
weights are never held twice. Accepted layouts: Hugging Face names (per-expert tensors
or transformers 5's fused `gate_up_proj` / `down_proj`), PyTorch or MLX conv weight
layout (decided by shape), and MLX-quantized files with `.scales` / `.biases`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .config import CheckpointError, Lfm2Config
from .model import Lfm2Model

log = logging.getLogger("laneserve.load")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
QUANT_PARTS = (".scales", ".biases")
# Names in MLX-converted MoE checkpoints (mlx-lm renames the SwiGLU projections).
MLX_RENAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"weight shards listed in the index are missing: {missing}")
    return files


def read_tensors(path: Path) -> dict[str, mx.array]:
    """All tensors of a directory, lazily: nothing is read until evaluated."""
    tensors: dict[str, mx.array] = {}
    for file in safetensors_files(path):
        try:
            tensors.update(mx.load(str(file)))
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"cannot read {file.name}: {e}") from None
    return tensors


def canonical_names(raw: dict[str, mx.array], cfg: Lfm2Config) -> dict[str, mx.array]:
    """Map every accepted naming and layout onto this model's parameter names."""
    out: dict[str, mx.array] = {}
    experts: dict[tuple[int, str], dict[int, mx.array]] = {}
    for name, value in raw.items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight":  # LFM2 ties its head to the embedding
            continue
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w1|w2|w3)\.weight", name)
        if m:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = value
            continue
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.experts\.(gate_up_proj|down_proj)", name)
        if m:
            prefix = f"layers.{m[1]}.feed_forward.experts"
            if m[2] == "gate_up_proj":  # [E, 2I, H]: w1 rows then w3 rows
                width = value.shape[1] // 2
                out[f"{prefix}.w1.weight"] = value[:, :width]
                out[f"{prefix}.w3.weight"] = value[:, width:]
            else:
                out[f"{prefix}.w2.weight"] = value
            continue
        m = re.fullmatch(r"(layers\.\d+\.feed_forward\.)(switch_mlp\.)?(gate_proj|up_proj|down_proj)(\..+)", name)
        if m:
            name = m[1] + ("experts." if m[2] else "") + MLX_RENAMES[m[3]] + m[4]
        if name.endswith("conv.conv.weight") and value.ndim == 3 and value.shape[1] == 1 and value.shape[2] == cfg.conv_kernel:
            value = value.transpose(0, 2, 1)  # PyTorch [H, 1, L] -> MLX [H, L, 1]
        out[name] = value
    for (layer, proj), per_expert in experts.items():
        missing = sorted(set(range(cfg.num_experts)) - set(per_expert))
        if missing:
            raise CheckpointError(f"layer {layer} lacks {proj} for experts {missing}")
        out[f"layers.{layer}.feed_forward.experts.{proj}.weight"] = mx.stack([per_expert[e] for e in range(cfg.num_experts)])
    return out


def ffn_widths(tensors: dict[str, mx.array], cfg: Lfm2Config) -> list[int]:
    """FFN width per layer, from the w1 weights (the configs' ff-dim fields disagree)."""
    widths = []
    for i in range(cfg.num_layers):
        key = f"layers.{i}.feed_forward.{'experts.' if cfg.is_moe_layer(i) else ''}w1.weight"
        if key not in tensors:
            raise CheckpointError(f"missing tensor model.{key}")
        widths.append(tensors[key].shape[-2])  # [.., F, H]: packed columns when quantized, rows never
    return widths


def quantization_of(cfg: Lfm2Config):
    """A class predicate for nn.quantize from config.json's `quantization` block."""
    block = cfg.quantization
    if not block:
        return None

    def predicate(path: str, module: nn.Module):
        override = block.get(f"model.{path}", block.get(path))
        if isinstance(override, dict):
            return {"group_size": override["group_size"], "bits": override["bits"], "mode": override.get("mode", "affine")}
        if override is False:
            return False
        return hasattr(module, "to_quantized")

    return predicate


def check_shapes(model: nn.Module, tensors: dict[str, mx.array]) -> None:
    expected = dict(nn.utils.tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join("model." + m for m in missing[:5])
        raise CheckpointError(f"missing tensor{'s' if len(missing) > 1 else ''} {shown}" + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise CheckpointError(f"tensor model.{name} has shape {tuple(tensors[name].shape)}, expected {tuple(param.shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        log.warning("ignoring %d tensors the model does not use, e.g. %s", len(unexpected), unexpected[:3])


def load_model(path: str | Path, dtype: str | None = None) -> tuple[Lfm2Model, Lfm2Config]:
    """Build the model of a checkpoint directory and load its weights.

    `dtype` ("float32", "float16", "bfloat16") casts floating weights; by default they
    stay as stored. The router and `expert_bias` always run in float32."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} {'is a file, not a directory' if path.exists() else 'does not exist'}")
    cfg = Lfm2Config.from_dir(path)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    tensors = canonical_names(read_tensors(path), cfg)
    model = Lfm2Model(cfg, ffn_widths(tensors, cfg))
    predicate = quantization_of(cfg)
    if predicate is not None:
        quantized = {name[: -len(".scales")] for name in tensors if name.endswith(".scales")}
        nn.quantize(
            model,
            group_size=cfg.quantization.get("group_size", 64),
            bits=cfg.quantization.get("bits", 4),
            mode=cfg.quantization.get("mode", "affine"),
            class_predicate=lambda p, m: p in quantized and predicate(p, m),
        )
    check_shapes(model, tensors)
    target_dtype = DTYPES[dtype] if dtype else None
    # MLX's CPU gather_mm runs only in float32, so there the routed experts stay float32
    # whatever the other weights run in; the MoE block casts its output back.
    float32_experts = cfg.is_moe and mx.default_device() == mx.cpu
    if float32_experts and dtype in ("float16", "bfloat16"):
        log.info("MoE experts run in float32 on the CPU (MLX's CPU gather_mm supports only float32)")

    def prepared(name: str, value: mx.array) -> mx.array:
        if name.endswith("expert_bias") or name.endswith("feed_forward.gate.weight"):
            return value.astype(mx.float32)
        if float32_experts and ".feed_forward.experts." in name and mx.issubdtype(value.dtype, mx.floating) and not name.endswith(QUANT_PARTS):
            return value.astype(mx.float32)
        if target_dtype is not None and mx.issubdtype(value.dtype, mx.floating) and not name.endswith(QUANT_PARTS):
            return value.astype(target_dtype)
        return value

    load_layer_by_layer(model, tensors, prepared, "tensor model.")
    model.eval()
    return model, cfg


def load_layer_by_layer(model: nn.Module, tensors: dict[str, mx.array], prepared, label: str) -> None:
    """Load `tensors` (lazy, checked) into `model` one layer at a time: each layer's
    tensors are read, passed through `prepared(name, value)` (a cast), materialised and
    their lazily loaded sources dropped before the next layer is read, so the weights
    are never held twice. Consumes `tensors`.

    A floating tensor holding NaN or infinity (as stored, or after the cast) is refused
    as `{label}{name}`: such a model runs and prints empty text instead of failing."""
    groups: dict[str, list[str]] = {}
    for name in tensors:
        m = re.match(r"layers\.(\d+)\.", name)
        groups.setdefault(m.group(0) if m else name, []).append(name)
    for names in groups.values():
        part = [(n, prepared(n, tensors.pop(n))) for n in names]
        model.load_weights(part, strict=False)
        finite = {n: mx.isfinite(v).all() for n, v in part if mx.issubdtype(v.dtype, mx.floating)}
        mx.eval([v for _, v in part], finite)
        bad = [n for n, ok in finite.items() if not ok.item()]
        if bad:
            raise CheckpointError(f"{label}{bad[0]} holds NaN or infinite values" + (f" (as do {len(bad) - 1} more)" if len(bad) > 1 else ""))

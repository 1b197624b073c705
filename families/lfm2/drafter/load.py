"""Loading a LiquidAI DSpark drafter directory for a loaded target: the config and its
pairing first, then every tensor checked against its parameter, then the runtime."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..config import CheckpointError, Lfm2Config
from ..loader import DTYPES, load_layer_by_layer, read_tensors
from ..model import Lfm2Model
from .config import DSparkConfig, check_pairing
from .model import DSparkModel
from .runtime import DSparkDrafter

log = logging.getLogger("laneserve.load")

DRAFTER_BITS = (8,)  # the only opt-in quantization of the drafter's linear layers
QUANT_GROUP = 64


def _checked_tensors(model: DSparkModel, tensors: dict[str, mx.array], target_hidden: int) -> dict[str, mx.array]:
    """The tensors the model uses, each checked against its parameter's shape."""
    cfg = model.config
    expected = dict(nn.utils.tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"drafter lacks tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:5])}")
    for name, param in expected.items():
        got, want = tuple(tensors[name].shape), tuple(param.shape)
        if got == want:
            continue
        why = ""
        if name == "fc.weight":
            why = f" = [hidden {cfg.hidden_size}, {len(cfg.target_layer_ids)} taps x target hidden {target_hidden}]"
        elif name.startswith("markov_head."):
            why = f" = [target vocab {cfg.vocab_size}, markov_rank {cfg.markov_rank}]"
        raise CheckpointError(f"drafter tensor {name} has shape {got}, expected {want}{why}")
    not_float = [name for name in expected if not mx.issubdtype(tensors[name].dtype, mx.floating)]
    if not_float:
        dtype = str(tensors[not_float[0]].dtype).removeprefix("mlx.core.")
        raise CheckpointError(f"drafter tensor {not_float[0]} is {dtype}, not floating point")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        log.warning("drafter: ignoring %d tensors it does not use, e.g. %s", len(unexpected), unexpected[:3])
    return {name: tensors[name] for name in expected}


def load_drafter(
    path: str | Path,
    target_model: Lfm2Model,
    target_config: Lfm2Config,
    dtype: str | None = None,
    bits: int | None = None,
    max_lanes: int = 16,
    compiled: bool = True,
    by_rows: bool | None = None,
) -> DSparkDrafter:
    """Load a LiquidAI DSpark drafter directory for a loaded target.

    The config and its pairing with the target are checked before any weight is read;
    every refusal is a CheckpointError naming the field or tensor. `dtype` casts the
    floating weights ("float32", "float16", "bfloat16"; default: as stored). `bits=8`
    is an explicit opt-in that quantizes the drafter's linear layers (MLX affine, group
    64); the Markov table and the one-row confidence head stay as loaded. `compiled`,
    `by_rows`: see DSparkDrafter."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"drafter directory {path} {'is a file, not a directory' if path.exists() else 'does not exist'}")
    if bits is not None and bits not in DRAFTER_BITS:
        raise CheckpointError(f"drafter bits {bits!r} is not supported; use {' or '.join(map(str, DRAFTER_BITS))}, or leave it unset")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    cfg = DSparkConfig.from_dir(path)
    check_pairing(cfg, target_config)
    tensors = {name.removeprefix("model."): value for name, value in read_tensors(path).items()}
    model = DSparkModel(cfg, target_config.hidden_size)
    tensors = _checked_tensors(model, tensors, target_config.hidden_size)
    cast = DTYPES[dtype] if dtype else None
    load_layer_by_layer(
        model, tensors, lambda n, v: v.astype(cast) if cast is not None else v, "drafter tensor "
    )
    if bits is not None:
        nn.quantize(
            model,
            group_size=QUANT_GROUP,
            bits=bits,
            # Linear layers only, and only where the input width splits into groups.
            class_predicate=lambda p, m: isinstance(m, nn.Linear) and p != "confidence_head.proj" and m.weight.shape[-1] % QUANT_GROUP == 0,
        )
        mx.eval(model.parameters())
        log.info("drafter linear layers quantized to %d bits (group %d)", bits, QUANT_GROUP)
    model.eval()
    return DSparkDrafter(model, target_model, max_lanes, compiled, by_rows)

"""Training a small dense LFM2 target from scratch, and exporting it as a Hugging Face
LFM2 directory that `load_model`, `laneserve generate --model DIR` and transformers read.

The model is the serving model itself (`Lfm2Model`), built from the config.json that
the export writes, so what trains is exactly what loads. The default shape (8.9M
parameters, 17.8 MB in bfloat16) leaves room in the 28 MB budget of the embedded default
for its drafter (7.5 MB) and tokenizer (0.3 MB):

    vocab 4096 | hidden 256 | 10 layers, attention at 2, 5, 8 (LFM2's early pattern),
    the rest gated short convs | 4 heads of 64, 2 KV heads | SwiGLU width 704

Training: next-token cross-entropy on random windows of the train array, AdamW with
warmup and cosine decay (loop.py), evaluation on fixed windows of the held-out array.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from ..bpe import BOS, EOS_TEXT, IM_END, PAD
from ..config import Lfm2Config
from ..model import Lfm2Model, ShortConv
from ..tiny import TinyShape, target_config
from .loop import DTYPES, OptimizerSettings, Run, RunSettings, Stepper, eval_windows, load_tokens, log, random_windows, read_state

SHAPES = {
    # The embedded default (see the module docstring).
    "default": TinyShape(hidden=256, layers=10, heads=4, kv_heads=2, ffn=704, attention=(2, 5, 8)),
    # CI and CPU smoke runs: the same layer pattern, seconds per hundred steps.
    "tiny": TinyShape(hidden=64, layers=4, heads=2, kv_heads=1, ffn=128, attention=(1, 3)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_config(shape: TinyShape, vocab: int, dtype: str = "bfloat16") -> dict:
    """The HF config.json of a target of this shape over this vocabulary."""
    return target_config("lfm2", replace(shape, vocab=vocab), dtype)


class ShiftedShortConv(ShortConv):
    """The same gated short conv with the same weights, its depthwise convolution
    written as L shifted multiply-adds: on CUDA, MLX's grouped-convolution backward
    dominated a whole training step; these elementwise ops cost next to nothing."""

    def __call__(self, x: mx.array) -> mx.array:
        u, c = self.gates(x)
        length, w = x.shape[1], self.conv.weight[:, :, 0]  # [H, L]: w[:, L-1] weights the current row
        padded = mx.pad(u, [(0, 0), (self.kernel - 1, 0), (0, 0)])
        v = sum(padded[:, k : k + length] * w[:, k] for k in range(self.kernel))
        return self.out_proj(c * v)


def build_model(config: dict, seed: int) -> Lfm2Model:
    """A freshly initialised target for training (its convs in the shifted form)."""
    cfg = Lfm2Config.from_dict(config)
    mx.random.seed(seed)
    model = Lfm2Model(cfg, [config["block_ff_dim"]] * cfg.num_layers)
    for layer in model.layers:
        if not layer.is_attention:
            layer.conv = ShiftedShortConv(cfg)
    init_weights(model, cfg.num_layers)
    return model


def init_weights(model: nn.Module, layers: int, std: float = 0.02) -> None:
    """GPT-2 style: matrices and the (tied) embedding N(0, std); the projections that
    write into the residual stream scaled by 1/sqrt(2 * layers) so the stream's variance
    does not grow with depth. Norm gains stay 1, conv kernels keep MLX's default."""
    residual_std = std / math.sqrt(2 * layers)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim < 2 or name.endswith("conv.conv.weight"):
            continue
        scale = residual_std if name.endswith(("out_proj.weight", "w2.weight")) else std
        weights.append((name, scale * mx.random.normal(p.shape)))
    model.load_weights(weights, strict=False)


def lm_loss(model: Lfm2Model, window: mx.array) -> tuple[mx.array, tuple]:
    """Mean next-token cross-entropy over a batch of windows [B, T+1], in float32."""
    h, _ = model(window[:, :-1])
    logits = model.head(h).astype(mx.float32)
    return nn.losses.cross_entropy(logits, window[:, 1:], reduction="mean"), ()


def evaluate(model: Lfm2Model, windows: np.ndarray, batch: int) -> dict:
    """Held-out loss (nats per token) and perplexity over fixed windows."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        part = mx.array(windows[i : i + batch])
        loss, _ = lm_loss(model, part)
        total += loss.item() * part.shape[0]
        count += part.shape[0]
    loss = total / count
    return {"eval_loss": loss, "eval_ppl": math.exp(loss)}


def hf_tensors(model: Lfm2Model, dtype) -> dict[str, mx.array]:
    """The model's weights under their Hugging Face names, conv kernels in PyTorch's
    Conv1d layout [H, 1, L] (MLX keeps [H, L, 1])."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("conv.conv.weight"):
            value = value.transpose(0, 2, 1)
        out["model." + name] = value.astype(dtype)
    return out


def export_target(model: Lfm2Model, config: dict, tokenizer_dir: Path, out: Path, dtype: str, training: dict) -> Path:
    """An HF LFM2 directory: config.json, generation_config.json, model.safetensors,
    the tokenizer files, and training.json (how it was made, for the model card)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype, "dtype": dtype}, indent=2) + "\n")
    generation = {"bos_token_id": BOS, "eos_token_id": [IM_END, EOS_TEXT], "pad_token_id": PAD}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"), hf_tensors(model, DTYPES[dtype]), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    log(f"exported target -> {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB weights)")
    return out


def parameter_count(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))


# --- command line -----------------------------------------------------------------------


def add_run_arguments(p: argparse.ArgumentParser, batch: int, lr: float, warmup: int, compile: bool) -> None:
    """Flags both trainers take: data, budget, schedule, precision, checkpoints, and
    the switch away from the trainer's default about compiling the step."""
    p.add_argument("--data", required=True, help="directory with train.npy and eval.npy (the corpus step)")
    p.add_argument("--out", required=True, help="run directory: checkpoint/ and the exported model/")
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock budget of this invocation (default 5)")
    p.add_argument("--steps", type=int, help="the schedule's length in steps (default: as many as fit in the budget, measured)")
    p.add_argument("--schedule-minutes", type=float, help="make the schedule as long as this many minutes of training, over all invocations")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--batch", type=int, default=batch, help=f"windows per step (default {batch})")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default {lr})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"warmup steps (default {warmup})")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype; masters stay float32 (bfloat16 on a GPU)")
    p.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows per evaluation (default 64)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: at the end only)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-minutes", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    if compile:
        p.add_argument("--no-compile", dest="compile", action="store_false", help="run the step uncompiled")
    else:
        p.add_argument("--compile", dest="compile", action="store_true", help="compile the step")
    p.set_defaults(compile=compile)


def run_settings(args) -> RunSettings:
    return RunSettings(args.minutes, args.steps, args.schedule_minutes, args.log_every, args.checkpoint_minutes, args.eval_every)


def optimizer_settings(args) -> OptimizerSettings:
    return OptimizerSettings(lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay)


def prepare_run_dir(out: Path, resume: bool) -> Path:
    """The checkpoint path; refuses to start over an existing run unless resuming."""
    checkpoint = out / "checkpoint"
    if resume and not (checkpoint / "state.json").exists():
        raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint}")
    if not resume and checkpoint.exists():
        raise FileExistsError(f"{checkpoint} exists: pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("target", help="train the LFM2 target and export an HF directory", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (the tokenizer step)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="default", help="model shape (default: the embedded default)")
    # Compiling fuses the elementwise work: 18 ms instead of 48 per step of 32 x 1024
    # tokens on an H200, after an 11 s first step.
    add_run_arguments(p, batch=32, lr=2e-3, warmup=200, compile=True)
    p.set_defaults(run=run)


def run(args) -> dict:
    out, tokenizer_dir = Path(args.out), Path(args.tokenizer)
    checkpoint = prepare_run_dir(out, args.resume)
    if args.resume:  # the architecture is the checkpoint's, whatever the flags say
        config = read_state(checkpoint)["config"]
    else:
        vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        config = model_config(SHAPES[args.shape], vocab)
    model = build_model(config, args.seed)
    log(f"target: {parameter_count(model) / 1e6:.2f} M parameters, {config['num_hidden_layers']} layers "
        f"({', '.join(str(i) for i, k in enumerate(config['layer_types']) if k == 'full_attention')} attention), "
        f"hidden {config['hidden_size']}, vocab {config['vocab_size']}")
    train, held_out = load_tokens(args.data, "train"), load_tokens(args.data, "eval")
    if train.ndim != 1:
        raise ValueError(f"{args.data} holds generated rows (drafter data); the target trains on the corpus step's arrays")
    if int(train.max()) >= config["vocab_size"]:
        raise ValueError(f"{args.data} holds token ids up to {int(train.max())}, beyond the vocabulary of {config['vocab_size']}: tokenized with another tokenizer?")
    windows = eval_windows(held_out, args.seq_len + 1, args.eval_windows)
    opt = optimizer_settings(args)
    stepper = Stepper(model, lm_loss, opt, args.dtype, compile=args.compile)
    loop = Run(stepper, checkpoint, config, run_settings(args), opt, args.seed)
    if args.resume:
        loop.resume()

    def next_batch(rng):
        return (mx.array(random_windows(train, rng, args.batch, args.seq_len + 1)),), args.batch * args.seq_len

    def export(result: dict):
        training = {
            "data": str(args.data), "step": loop.progress.step, "tokens": loop.progress.tokens,
            "trained_minutes": round(loop.progress.trained_seconds / 60, 2), "eval": result,
            "batch": args.batch, "seq_len": args.seq_len, "schedule": asdict(loop.schedule), "compute_dtype": args.dtype,
        }
        export_target(stepper.use_weights(mx.float32), config, tokenizer_dir, out / "model", args.export_dtype, training)

    return loop.train(next_batch, lambda: evaluate(model, windows, args.batch), export)

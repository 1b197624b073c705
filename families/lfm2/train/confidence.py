"""Refitting a trained drafter's confidence head to the survival of greedy drafts.

The drafter trainer fits the confidence head toward `1 - TV(p_draft, p_target)`: the
chance that speculative sampling at temperature 1 accepts a draft. A greedy verify
accepts a draft when it is the target's argmax, which happens more often: on the
default's held-out replies its first drafter's head said 0.61-0.64 per row where
0.78-0.89 of the drafts survived. Pricing multiplies these chances along the window,
so it verified too few rows and priced drafting below what it pays.

This step keeps every other weight and refits the head alone (one linear map of the
block's final rows and the Markov features, which the trainer already detaches) by
logistic regression toward greedy survival: whether row k's argmax is the target's
choice, counted only where rows 0..k-1 survived, as a verify sees it. The rows are the
generate step's greedy continuations (give it `--temperatures 0`), teacher-forced, so
the previous token each row's Markov feature reads is the one a surviving chain drew.

    python -m families.lfm2.train confidence --target T --drafter D --data GEN --out D2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..drafter import DSparkConfig, DSparkModel
from ..loader import load_model
from .drafter import DrafterData, block_outputs, export_drafter
from .loop import log


def survival_examples(drafter: DSparkModel, target, windows: np.ndarray, anchors: np.ndarray,
                      batch: int) -> tuple[mx.array, mx.array, mx.array]:
    """(features [N, F], survived [N], row [N]) for every block row whose earlier rows all
    survived: the rows a greedy verify actually judges."""
    features, survived, rows = [], [], []
    for i in range(0, len(windows), batch):
        out = block_outputs(drafter, target, mx.array(windows[i : i + batch]), mx.array(anchors[i : i + batch]))
        match = mx.argmax(out.logits, axis=-1) == out.target_choice  # [B, A, g]
        judged = mx.cumprod(mx.concatenate([mx.ones_like(match[..., :1]), match[..., :-1]], axis=-1), axis=-1)
        keep = np.array(judged).reshape(-1).astype(bool)
        g = match.shape[-1]
        features.append(np.array(out.features.astype(mx.float32)).reshape(-1, out.features.shape[-1])[keep])
        survived.append(np.array(match).reshape(-1)[keep])
        rows.append(np.tile(np.arange(g), match.size // g)[keep])
    return mx.array(np.concatenate(features)), mx.array(np.concatenate(survived).astype(np.float32)), mx.array(np.concatenate(rows))


def bce(logits: mx.array, labels: mx.array) -> mx.array:
    return (nn.softplus(logits) - labels * logits).mean()


def report(head: nn.Linear, features: mx.array, survived: mx.array, rows: mx.array, block: int) -> dict:
    """Log loss, and per row the mean confidence against the share that survived."""
    logits = head(features).squeeze(-1)
    confidence = mx.sigmoid(logits)
    per_row = {}
    for k in range(block):
        at = rows == k
        n = at.sum().item()
        if n:
            per_row[k] = {"confidence": (confidence * at).sum().item() / n, "survived": (survived * at).sum().item() / n, "rows": n}
    return {"log_loss": bce(logits, survived).item(), "per_row": per_row}


def refit(head: nn.Linear, features: mx.array, survived: mx.array, steps: int, lr: float) -> None:
    """Full-batch Adam on the head's weight and bias, from where they are."""
    optimizer = optim.Adam(lr)
    loss_and_grad = nn.value_and_grad(head, lambda m: bce(m(features).squeeze(-1), survived))
    for step in range(steps):
        loss, grads = loss_and_grad(head)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state)
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step:5d} | log loss {loss.item():.4f}")


def run(args) -> dict:
    drafter_dir, data, out = Path(args.drafter), Path(args.data), Path(args.out)
    if out.exists():
        raise FileExistsError(f"{out} exists: choose another --out")
    config = json.loads((drafter_dir / "config.json").read_text())
    target, target_cfg = load_model(args.target, dtype="float32")
    drafter = DSparkModel(DSparkConfig.from_dict(config), target_cfg.hidden_size)
    drafter.load_weights(list(mx.load(str(drafter_dir / "model.safetensors")).items()))
    drafter.set_dtype(mx.float32)
    block = drafter.config.block_size
    parts = {}
    for part, count in (("train", args.windows), ("eval", args.eval_windows)):
        source = DrafterData(data, part, seq_len=0)
        windows, anchors = source.fixed(count, args.anchors, block)
        parts[part] = survival_examples(drafter, target, windows, anchors, args.batch)
        log(f"{part}: {parts[part][0].shape[0]} judged rows from {len(windows)} windows")
    head = drafter.confidence_head.proj
    before = report(head, *parts["eval"], block)
    refit(head, *parts["train"][:2], args.steps, args.lr)
    after = report(head, *parts["eval"], block)
    for name, r in (("before", before), ("after", after)):
        shown = " ".join(f"{k}:{v['confidence']:.2f}/{v['survived']:.2f}" for k, v in r["per_row"].items())
        log(f"eval {name}: log loss {r['log_loss']:.4f} | row: confidence/survived {shown}")
    training = json.loads((drafter_dir / "training.json").read_text()) if (drafter_dir / "training.json").exists() else {}
    training["confidence_refit"] = {"data": str(data), "label": "greedy survival", "steps": args.steps, "lr": args.lr,
                                    "windows": args.windows, "anchors": args.anchors, "eval_before": before, "eval_after": after}
    export_drafter(drafter, config, out, config.get("torch_dtype", "bfloat16"), training)
    return after


def add_parser(sub) -> None:
    p = sub.add_parser("confidence", help="refit a trained drafter's confidence head to greedy survival", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF directory")
    p.add_argument("--drafter", required=True, help="the trained drafter's directory (the drafter step's OUT/model)")
    p.add_argument("--data", required=True, help="the generate step's directory, greedy rows")
    p.add_argument("--out", required=True, help="drafter directory to write (the same weights, the head refitted)")
    p.add_argument("--windows", type=int, default=512, help="train rows to read (default 512)")
    p.add_argument("--eval-windows", type=int, default=128, help="eval rows to read (default 128)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per row (default 32)")
    p.add_argument("--batch", type=int, default=16, help="rows per forward (default 16)")
    p.add_argument("--steps", type=int, default=500, help="full-batch optimizer steps (default 500)")
    p.add_argument("--lr", type=float, default=0.01)
    p.set_defaults(run=run)

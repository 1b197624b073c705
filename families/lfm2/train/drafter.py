"""Training a DSpark drafter for a trained target, and exporting LiquidAI's drafter
directory format (config.json with `dflash_config`, model.safetensors).

The recipe: teacher-forced blocks at random anchors over the target's own taps. The
frozen target runs over a window and yields its taps (residuals after
`target_layer_ids`) and its next-token distributions. For each anchor position a, the
block `[x_a] + [mask] * (g - 1)` at positions a .. a+g-1 attends to the context rows of
the positions before a (`hidden_norm(fc(taps))`, exactly what serving appends for
committed tokens) and to its own block; row k is trained to propose x_{a+k+1}:

    l_k  = U_k + markov_w2(markov_w1[prev_k]),  prev_k = x_{a+k} (the TRUE previous token)
    loss = sum_k w_k CE(l_k, x_{a+k+1}) / sum_k w_k,  w_k = exp(-k / gamma)
         + confidence_weight * BCE(sigmoid(proj([h_k ; markov_w1[prev_k]])), agreement_k)
    agreement_k = 1 - 0.5 * |softmax(l_k) - p_target(x_{a+k+1} | x_<=a+k)|_1

The decay weights favour early rows, whose acceptance gates all later ones. The
agreement is the chance that speculative sampling accepts row k's draft given the rows
before it were accepted, which is what the confidence head predicts at serving time; its
inputs are detached so calibrating it never bends the drafting features.

Data: the corpus step's arrays, or the generate step's rows (text the target wrote
itself, anchors only in its continuation), which match what the drafter meets when
serving: on an H200, 2-minute drafters for a 4-minute target accepted about one draft
per greedy round on chat prompts when trained on the corpus, up to three on long
replies when trained on generated rows.

Batching: many anchors per window, all blocks of a window in one attention call over
`[context rows ; all blocks]`, with a mask that lets a block see only the context rows
before its anchor and itself. The modules and weights are the serving model's
(`DSparkModel`); only the attention layout differs from `DSparkDrafter.propose`, and the
tests check that both give the same logits and confidences.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from ..config import Lfm2Config
from ..drafter import DSparkConfig, DSparkModel
from ..loader import load_model
from ..model import Lfm2Model
from .generate import META
from .loop import DTYPES, Run, Stepper, eval_windows, load_tokens, log, random_windows, read_state
from .target import add_run_arguments, optimizer_settings, parameter_count, prepare_run_dir, run_settings

MASK_TOKEN = "<|mask|>"


@dataclass(frozen=True)
class DrafterShape:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    block_size: int = 8
    markov_rank: int = 64
    taps: tuple[int, ...] | None = None  # target layers; default: 4 spread over the target


SHAPES = {
    # The embedded default: 3.7M parameters, 7.5 MB in bfloat16 for the default target.
    # A third layer lets a block follow the target's text one more token ahead; the MLP
    # width costs no more operations per round, which is what a round's time counts.
    "default": DrafterShape(layers=3, intermediate=1024),
    # CI and CPU smoke runs, for the "tiny" target shape.
    "tiny": DrafterShape(layers=1, heads=2, kv_heads=1, head_dim=32, intermediate=128, block_size=4, markov_rank=16, taps=(1, 2)),
}


def default_taps(target_layers: int, count: int = 4) -> list[int]:
    """`count` layers from layer 2 to the one before the last, evenly spread (the
    published drafters tap [2, 5, 8, 11, 14] of 16)."""
    low, high = min(2, target_layers - 2), target_layers - 2
    return sorted({round(low + i * (high - low) / max(count - 1, 1)) for i in range(count)})


def drafter_config(shape: DrafterShape, target: Lfm2Config, mask_token_id: int, dtype: str = "bfloat16") -> dict:
    """LiquidAI's drafter config.json for a target (hidden size, vocabulary, RoPE theta
    and layer count taken from it)."""
    taps = list(shape.taps) if shape.taps is not None else default_taps(target.num_layers)
    return {
        "architectures": ["Lfm2DSparkDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": target.vocab_size,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": shape.block_size,
        "markov_rank": shape.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "rope_is_neox_style": False,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": taps, "num_target_layers": target.num_layers},
    }


def build_drafter(config: dict, target_hidden: int, seed: int) -> DSparkModel:
    mx.random.seed(seed)
    model = DSparkModel(DSparkConfig.from_dict(config), target_hidden)
    init_weights(model)
    return model


def init_weights(model: DSparkModel, std: float = 0.02) -> None:
    """Matrices N(0, std), the residual writers (o_proj, down_proj) scaled by
    1/sqrt(2 * layers). The Markov correction and the confidence projection start at
    zero: the chain begins as the plain block logits and every confidence at 0.5."""
    residual_std = std / math.sqrt(2 * len(model.layers))
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"):
            weights.append((name, mx.zeros(p.shape)))
        elif name == "markov_head.markov_w1.weight":
            weights.append((name, mx.random.normal(p.shape)))
        elif p.ndim >= 2:
            scale = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            weights.append((name, scale * mx.random.normal(p.shape)))
    model.load_weights(weights, strict=False)


# --- data -------------------------------------------------------------------------------


class DrafterData:
    """Where a part's windows come from: the corpus step's flat array (random windows,
    anchors anywhere) or the generate step's rows (one window per row, anchors only in
    the target's own continuation, each row's prompt as context)."""

    def __init__(self, data: Path, part: str, seq_len: int):
        tokens = load_tokens(data, part)
        if tokens.ndim == 2:
            self.rows, self.tokens, self.length = tokens, None, tokens.shape[1]
            sizes = data / f"{part}_prompts.npy"  # rows written before prompts varied have none
            self.first_anchors = np.load(sizes) if sizes.exists() else np.full(len(tokens), json.loads((data / META).read_text())["prompt_tokens"])
        else:
            self.rows, self.tokens, self.length = None, tokens, seq_len

    def prompts(self) -> str:
        """The rows' prompt lengths, for the log."""
        low, high = int(self.first_anchors.min()), int(self.first_anchors.max())
        return f"{low}-token prompts" if low == high else f"prompts of {low}-{high} tokens"

    def sample(self, rng: np.random.Generator, count: int, anchors: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """`count` random windows [count, length] and `anchors` block anchors in each."""
        if self.rows is None:
            return random_windows(self.tokens, rng, count, self.length), sample_anchors(rng, np.ones(count, int), self.length, anchors, block)
        index = rng.integers(0, len(self.rows), size=count)
        return self.rows[index].astype(np.int32), sample_anchors(rng, self.first_anchors[index], self.length, anchors, block)

    def fixed(self, count: int, anchors: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The same windows and anchors on every call (for evaluation)."""
        rng = np.random.default_rng(0)
        if self.rows is None:
            windows = eval_windows(self.tokens, self.length, count)
            return windows, sample_anchors(rng, np.ones(len(windows), int), self.length, anchors, block)
        return self.rows[:count].astype(np.int32), sample_anchors(rng, self.first_anchors[:count], self.length, anchors, block)


# --- the batched training forward -------------------------------------------------------


def sample_anchors(rng: np.random.Generator, lows: np.ndarray, length: int, count: int, block: int) -> np.ndarray:
    """[len(lows), count] sorted distinct anchors per window, from its `lows[i]` (at least
    1: serving always has a prompt before the anchor) to where the g labels still fit."""
    high = length - block - 1
    if high - int(np.max(lows)) + 1 < count:
        raise ValueError(f"a window of {length} tokens with a {int(np.max(lows))}-token prompt has fewer than {count} anchors for blocks of {block}")
    return np.sort(np.stack([rng.choice(np.arange(low, high + 1), size=count, replace=False) for low in lows]), axis=1).astype(np.int32)


def block_mask(anchors: mx.array, length: int, block: int) -> mx.array:
    """[B, 1, A*g, T + A*g] boolean: a block's rows see the context rows before its
    anchor and every row of their own block (no causal order inside a block, as at
    serving), nothing of the other blocks."""
    batch, count = anchors.shape
    rows = count * block
    row_anchor = mx.repeat(anchors, block, axis=1)  # [B, A*g]
    context = mx.arange(length)[None, None, :] < row_anchor[:, :, None]  # [B, A*g, T]
    row_block = mx.arange(rows) // block
    own = row_block[:, None] == row_block[None, :]  # [A*g, A*g]
    blocks = mx.broadcast_to(own[None], (batch, rows, rows))
    return mx.concatenate([context, blocks], axis=-1)[:, None]


def block_hidden(drafter: DSparkModel, embed: nn.Embedding, taps: mx.array, tokens: mx.array, anchors: mx.array) -> mx.array:
    """The final-normed block rows h_k [B, A, g, H] for blocks at `anchors` [B, A] over
    windows `tokens` [B, T] whose target taps are `taps` [B, T, n_taps * H_target]."""
    cfg = drafter.config
    (batch, length), count, g = tokens.shape, anchors.shape[1], cfg.block_size
    offsets = anchors.reshape(-1)  # each block is its own "lane" at its anchor's position
    context = drafter.context(taps)  # [B, T, H]
    first = mx.take_along_axis(tokens, anchors, axis=1)[..., None]  # [B, A, 1]
    block = mx.concatenate([first, mx.full((batch, count, g - 1), cfg.mask_token_id, dtype=tokens.dtype)], axis=-1)
    h = embed(block.reshape(batch * count, g)).astype(context.dtype)  # [B*A, g, H]
    mask = block_mask(anchors, length, g)
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q, k_block, v_block = attn.qkv(x)  # [B*A, heads or kv, g, D]
        q, k_block = attn.rope(q, offsets), attn.rope(k_block, offsets)
        k_context, v_context = attn.keys_values(context, 0)  # [B, kv, T, D]
        q, k_block, v_block = (gather_blocks(t, batch, count) for t in (q, k_block, v_block))
        keys = mx.concatenate([k_context, k_block], axis=2)
        values = mx.concatenate([v_context, v_block], axis=2)
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)  # [B, heads, A*g, D]
        o = o.reshape(batch, attn.heads, count, g, attn.head_dim).transpose(0, 2, 3, 1, 4)
        h = h + attn.o_proj(o.reshape(batch * count, g, attn.heads * attn.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(batch, count, g, -1)


def gather_blocks(x: mx.array, batch: int, count: int) -> mx.array:
    """[B*A, heads, g, D] per block -> [B, heads, A*g, D] per window."""
    _, heads, g, d = x.shape
    return x.reshape(batch, count, heads, g, d).transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * g, d)


def block_rows(x: mx.array, anchors: mx.array, block: int, shift: int = 0) -> mx.array:
    """x [B, T, ...] at rows anchor + shift + k -> [B, A, g, ...]."""
    batch, count = anchors.shape
    index = (anchors[..., None] + shift + mx.arange(block)).reshape(batch, count * block)
    if x.ndim == 3:
        index = index[..., None]
    out = mx.take_along_axis(x, index, axis=1)
    return out.reshape(batch, count, block, *x.shape[2:])


@dataclass
class BlockOutputs:
    logits: mx.array  # [B, A, g, V] float32: the Markov-corrected chain logits l_k
    labels: mx.array  # [B, A, g]: x_{a+k+1}
    confidence_logits: mx.array  # [B, A, g] float32, before the sigmoid
    agreement: mx.array  # [B, A, g] float32: 1 - TV(p_draft, p_target), no gradient
    target_choice: mx.array  # [B, A, g]: the target's greedy token at each row
    target_logits: mx.array  # [B, A, g, V] float32, no gradient
    features: mx.array  # [B, A, g, H + rank]: the confidence head's input, no gradient


def block_outputs(drafter: DSparkModel, target: Lfm2Model, tokens: mx.array, anchors: mx.array) -> BlockOutputs:
    """Everything the losses and metrics read, for windows `tokens` [B, T] and anchors [B, A]."""
    cfg = drafter.config
    g = cfg.block_size
    last, tapped = target(tokens, taps=cfg.target_layer_ids)
    taps = mx.stop_gradient(mx.concatenate(tapped, axis=-1))
    h = block_hidden(drafter, target.embed_tokens, taps, tokens, anchors)
    base = target.embed_tokens.as_linear(h).astype(mx.float32)  # U_k, the target's tied head
    prev = block_rows(tokens, anchors, g)  # teacher forcing: the true x_{a+k}
    labels = block_rows(tokens, anchors, g, shift=1)
    markov = drafter.markov_head.markov_w1(prev)
    logits = base + drafter.markov_head.markov_w2(markov).astype(mx.float32)
    target_logits = mx.stop_gradient(target.head(block_rows(last, anchors, g)).astype(mx.float32))
    p_draft = mx.softmax(mx.stop_gradient(logits), axis=-1)
    agreement = 1 - 0.5 * mx.abs(p_draft - mx.softmax(target_logits, axis=-1)).sum(axis=-1)
    features = mx.stop_gradient(mx.concatenate([h, markov.astype(h.dtype)], axis=-1))
    confidence_logits = drafter.confidence_head.proj(features).astype(mx.float32).squeeze(-1)
    return BlockOutputs(logits, labels, confidence_logits, agreement, mx.argmax(target_logits, axis=-1), target_logits, features)


def position_weights(block: int, gamma: float) -> mx.array:
    return mx.exp(-mx.arange(block, dtype=mx.float32) / gamma)


def accepted(matches: mx.array) -> mx.array:
    """Per block, how many leading rows match: the drafts a greedy verify accepts."""
    return mx.cumprod(matches.astype(mx.float32), axis=-1).sum(axis=-1)


def block_cross_entropy(out: BlockOutputs, soft_labels: float = 0.0) -> mx.array:
    """Per row [B, A, g]: cross-entropy of the chain logits against the label token,
    mixed with a `soft_labels` share of cross-entropy against the target's whole
    distribution there. A row's label is one draw (or the argmax) of that distribution;
    the distribution also says how near the runners-up are, which a greedy verify's
    near-ties turn on."""
    hard = nn.losses.cross_entropy(out.logits, out.labels)
    if not soft_labels:
        return hard
    soft = -(mx.softmax(out.target_logits, axis=-1) * nn.log_softmax(out.logits, axis=-1)).sum(axis=-1)
    return (1 - soft_labels) * hard + soft_labels * soft


def drafter_loss(gamma: float, confidence_weight: float, soft_labels: float = 0.0):
    """The training loss `(drafter, target, tokens, anchors) -> (loss, (ce, conf_err, accept))`."""

    def loss_fn(drafter: DSparkModel, target: Lfm2Model, tokens: mx.array, anchors: mx.array):
        out = block_outputs(drafter, target, tokens, anchors)
        w = position_weights(drafter.config.block_size, gamma)
        ce = (block_cross_entropy(out, soft_labels) * w).sum(axis=-1).mean() / w.sum()
        z, y = out.confidence_logits, out.agreement
        bce = (nn.softplus(z) - y * z).mean()  # BCE(sigmoid(z), y) with a soft label y
        conf_err = mx.abs(mx.sigmoid(z) - y).mean()
        accept = accepted(mx.argmax(out.logits, axis=-1) == out.target_choice).mean()
        return ce + confidence_weight * bce, (ce, conf_err, accept)

    return loss_fn


def evaluate(drafter: DSparkModel, target: Lfm2Model, windows: np.ndarray, anchors: np.ndarray, batch: int, gamma: float) -> dict:
    """Held-out block cross-entropy, confidence error, and two teacher-forced acceptance
    estimates per block: greedy (leading rows whose argmax is the target's) and sampled
    (the sum over rows of the product of agreements)."""
    sums = {"eval_ce": 0.0, "eval_conf_err": 0.0, "accept_greedy": 0.0, "accept_sampled": 0.0}
    w = position_weights(drafter.config.block_size, gamma)
    for i in range(0, len(windows), batch):
        out = block_outputs(drafter, target, mx.array(windows[i : i + batch]), mx.array(anchors[i : i + batch]))
        n = out.labels.shape[0]
        values = {
            "eval_ce": (nn.losses.cross_entropy(out.logits, out.labels) * w).sum(axis=-1).mean() / w.sum(),
            "eval_conf_err": mx.abs(mx.sigmoid(out.confidence_logits) - out.agreement).mean(),
            "accept_greedy": accepted(mx.argmax(out.logits, axis=-1) == out.target_choice).mean(),
            "accept_sampled": mx.cumprod(out.agreement, axis=-1).sum(axis=-1).mean(),
        }
        for k, v in values.items():
            sums[k] += v.item() * n
    return {k: v / len(windows) for k, v in sums.items()}


def widen_mlp(weights: dict[str, mx.array], width: int, wider: int, seed: int, std: float = 0.02) -> dict[str, mx.array]:
    """A drafter's weights with every MLP widened from `width` to `wider` units without
    changing what it computes: the new units' down-projection columns start at zero (so
    they add nothing yet), their gate and up rows at N(0, std) (so they learn)."""
    if wider < width:
        raise ValueError(f"--intermediate {wider} would narrow the MLP of {width} units; it only widens")
    key = mx.random.key(seed)
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            key, sub = mx.random.split(key)
            out[name] = mx.concatenate([w, (std * mx.random.normal((wider - width, w.shape[1]), key=sub)).astype(w.dtype)])
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = mx.concatenate([w, mx.zeros((w.shape[0], wider - width), dtype=w.dtype)], axis=1)
    return out


def deepen(initial: dict[str, mx.array], fresh: dict[str, mx.array]) -> dict[str, mx.array]:
    """A drafter's weights `initial` with the layers a deeper build of it adds, taken
    from that build's weights `fresh`, their residual writers (o_proj, down_proj) at zero:
    each new layer passes its input through until it learns, so what the drafter computes
    is unchanged."""
    added = {name: mx.zeros_like(w) if name.endswith(("o_proj.weight", "down_proj.weight")) else w
             for name, w in fresh.items() if name not in initial}
    return {**initial, **added}


# --- export -----------------------------------------------------------------------------


def export_drafter(drafter: DSparkModel, config: dict, out: Path, dtype: str, training: dict) -> Path:
    """LiquidAI's drafter directory: config.json, model.safetensors (no `model.` prefix),
    and training.json (how it was made, for the model card)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    weights = {name: value.astype(DTYPES[dtype]) for name, value in tree_flatten(drafter.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    log(f"exported drafter -> {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB weights)")
    return out


# --- command line -----------------------------------------------------------------------


def add_parser(sub) -> None:
    p = sub.add_parser("drafter", help="train a DSpark drafter for a trained target and export it", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the trained target's HF directory (the target step's OUT/model)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="default", help="drafter shape (default: the embedded default)")
    p.add_argument("--taps", help="target layers to read, comma-separated (default: the shape's)")
    p.add_argument("--block-size", type=int, help="proposals per round (default: the shape's, or with --init the "
                                                   "initial drafter's: no weight depends on it, so a block may grow)")
    p.add_argument("--anchors", type=int, default=64, help="blocks per window (default 64)")
    p.add_argument("--gamma", type=float, default=4.0, help="position weight decay exp(-k/gamma) (default 4)")
    p.add_argument("--confidence-weight", type=float, default=1.0, help="weight of the confidence BCE (default 1)")
    p.add_argument("--soft-labels", type=float, default=0.0,
                   help="share of each row's cross-entropy taken against the target's distribution instead of the "
                        "label token, 0..1 (default 0)")
    # Compiling this step took 90 s on an H200 to save 3 ms of 12 per step: it only pays
    # in runs of many minutes, so it is opt-in here.
    add_run_arguments(p, batch=16, lr=1e-3, warmup=100, compile=False)
    p.add_argument("--init", help="start from this exported drafter directory (its config and weights; the optimizer "
                                  "and schedule start afresh): more training for a shipped drafter")
    p.add_argument("--intermediate", type=int, help="with --init: widen its MLPs to this many units, new units silent "
                                                    "at first (the initial drafter's outputs are unchanged)")
    p.add_argument("--layers", type=int, help="with --init: deepen it to this many layers, the new ones after its own and "
                                              "passing their input through at first (the outputs are unchanged)")
    p.set_defaults(run=run)


def shape_from(args) -> DrafterShape:
    shape = SHAPES[args.shape]
    if args.taps:
        shape = DrafterShape(**{**asdict(shape), "taps": tuple(int(t) for t in args.taps.split(","))})
    if args.block_size:
        shape = DrafterShape(**{**asdict(shape), "block_size": args.block_size})
    return shape


def run(args) -> dict:
    if args.resume and args.init:
        raise ValueError("--resume continues OUT/checkpoint; --init starts a new run from a drafter: give one of them")
    if not 0 <= args.soft_labels <= 1:
        raise ValueError(f"--soft-labels is a share of the cross-entropy, within 0..1, not {args.soft_labels}")
    out, target_dir = Path(args.out), Path(args.target)
    checkpoint = prepare_run_dir(out, args.resume)
    target, target_cfg = load_model(target_dir, dtype=args.dtype)
    target.freeze()
    if args.resume:  # the architecture is the checkpoint's, whatever the flags say
        config = read_state(checkpoint)["config"]
    elif args.init:  # and here the initial drafter's
        config = {k: v for k, v in json.loads((Path(args.init) / "config.json").read_text()).items() if k != "torch_dtype"}
        if args.block_size:
            config["block_size"] = args.block_size
    else:
        mask = Tokenizer.from_file(str(target_dir / "tokenizer.json")).token_to_id(MASK_TOKEN)
        if mask is None:
            raise ValueError(f"the target tokenizer at {target_dir} has no {MASK_TOKEN} token")
        config = drafter_config(shape_from(args), target_cfg, mask)
    if args.intermediate is not None and not args.init:
        raise ValueError("--intermediate widens the MLP of an --init drafter; a new drafter takes its width from --shape")
    if args.layers is not None and not args.init:
        raise ValueError("--layers deepens an --init drafter; a new drafter takes its depth from --shape")
    if args.layers is not None and args.layers < config["num_hidden_layers"]:
        raise ValueError(f"--layers {args.layers} would drop layers of a drafter of {config['num_hidden_layers']}; it only deepens")
    initial = dict(mx.load(str(Path(args.init) / "model.safetensors"))) if args.init else {}
    if args.intermediate is not None:
        initial = widen_mlp(initial, config["intermediate_size"], args.intermediate, args.seed)
        config = {**config, "intermediate_size": args.intermediate}
    if args.layers is not None:
        config = {**config, "num_hidden_layers": args.layers}
    drafter = build_drafter(config, target_cfg.hidden_size, args.seed)
    if args.init:
        drafter.load_weights(list(deepen(initial, dict(tree_flatten(drafter.parameters()))).items()))
        drafter.set_dtype(mx.float32)  # master weights, whatever the file's dtype
        log(f"initial weights from {args.init}")
    cfg = drafter.config
    log(f"drafter: {parameter_count(drafter) / 1e6:.2f} M parameters, {cfg.num_layers} layers, block {cfg.block_size}, "
        f"taps {list(cfg.target_layer_ids)} of {target_cfg.num_layers}, markov rank {cfg.markov_rank}")
    train, held_out = DrafterData(Path(args.data), "train", args.seq_len), DrafterData(Path(args.data), "eval", args.seq_len)
    if train.rows is not None:
        log(f"data: {len(train.rows)} generated rows of {train.length} tokens, anchors after {train.prompts()}")
    windows, eval_anchors = held_out.fixed(args.eval_windows, args.anchors, cfg.block_size)
    opt = optimizer_settings(args)
    loss_fn = drafter_loss(args.gamma, args.confidence_weight, args.soft_labels)
    stepper = Stepper(drafter, lambda model, *batch: loss_fn(model, target, *batch), opt, args.dtype, compile=args.compile)
    loop = Run(stepper, checkpoint, config, run_settings(args), opt, args.seed, metric_names=("ce", "conf_err", "accept"))
    if args.resume:
        loop.resume()

    def next_batch(rng):
        tokens, anchors = train.sample(rng, args.batch, args.anchors, cfg.block_size)
        return (mx.array(tokens), mx.array(anchors)), args.batch * args.anchors * cfg.block_size

    def export(result: dict):
        training = {
            "target": str(target_dir), "data": str(args.data), "step": loop.progress.step, "block_rows": loop.progress.tokens,
            "trained_minutes": round(loop.progress.trained_seconds / 60, 2), "eval": result, "batch": args.batch,
            "seq_len": args.seq_len, "anchors": args.anchors, "gamma": args.gamma, "soft_labels": args.soft_labels, "schedule": asdict(loop.schedule),
            "compute_dtype": args.dtype, **({"init": str(args.init)} if args.init else {}),
        }
        export_drafter(stepper.use_weights(mx.float32), config, out / "model", args.export_dtype, training)

    def run_eval():
        return evaluate(drafter, target, windows, eval_anchors, args.batch, args.gamma)

    return loop.train(next_batch, run_eval, export)

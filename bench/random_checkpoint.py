"""Random LFM2 checkpoints with the real released shapes, for benchmarks.

    python -m bench.random_checkpoint --preset lfm2.5-2.6b --out /tmp/lfm2.5-2.6b-random

writes a Hugging Face directory (config.json, generation_config.json, sharded
safetensors with model.safetensors.index.json, tokenizer.json, tokenizer_config.json)
that laneserve and mlx-lm both load. Throughput depends on shapes, not on values, so
random weights of the real shape measure what the released model would.

Each tensor is drawn directly in the target dtype with mx.random, written to its shard
and dropped before the next is drawn: memory holds one tensor at a time, never the
whole model. Shard headers are computed up front from the shapes, so no shard is ever
assembled in memory either. Weights are scaled like a trained model's (standard
deviation 1/sqrt(fan_in), norms near 1) so activations stay O(1) through every layer
and finite in bf16. The tokenizer is a small trained BPE while config.json keeps the
real vocab_size, as released models pad their embedding past the tokenizer.

`--decisive S` scales every layer's output projections (attention and conv `out_proj`,
feed-forward and expert `w2`) by S, as bench_engine's `--decisive` does in memory: the
residual stream keeps its input token's direction and greedy choices win by wide
margins, as a trained model's do, so a GPU's verify rows and one-row steps agree and
the scripted drafter keeps its track. On disk, every server loads the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from families.lfm2.bpe import BOS, EOS_TEXT, IM_END, PAD
from families.lfm2.tiny import TinyShape, target_config, write_tokenizer

# kind, shape. Real shapes from DESIGN.md section 3; the tiny ones keep the real head
# size (64) and layer interleave so they exercise the same kernels on a CPU.
PRESETS: dict[str, tuple[str, TinyShape]] = {
    "lfm2.5-2.6b": (
        "lfm2",
        TinyShape(
            vocab=128000, hidden=2048, layers=30, heads=32, kv_heads=8, ffn=10752,
            rope_theta=1e7, max_position=128000, attention=(2, 5, 9, 13, 17, 21, 24, 27),
        ),
    ),
    "lfm2-8b-a1b": (
        "lfm2_moe",
        TinyShape(
            vocab=128000, hidden=2048, layers=24, heads=32, kv_heads=8, ffn=7168,
            experts=32, experts_per_token=4, expert_ffn=1792, dense_layers=2,
            rope_theta=5e6, max_position=128000, attention=(2, 6, 10, 14, 18, 21),
        ),
    ),
    "tiny": (
        "lfm2",
        TinyShape(vocab=4096, hidden=256, layers=8, heads=4, kv_heads=2, ffn=768, attention=(2, 5)),
    ),
    "tiny-moe": (
        "lfm2_moe",
        TinyShape(
            vocab=4096, hidden=256, layers=8, heads=4, kv_heads=2, ffn=768,
            experts=8, experts_per_token=2, expert_ffn=192, dense_layers=2, attention=(2, 5),
        ),
    ),
}
TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # safetensors dtype tags
MX_DTYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
SHARD_BYTES = 2 * 10**9
# The embedding doubles as the head (tied): std 0.2 gives logits a spread of a few units
# (0.2 * sqrt(hidden)) without each token predicting itself.
EMBEDDING_STD = 0.2
TOKENIZER_VOCAB = 4096  # the small trained BPE; config.json keeps the real vocab


@dataclass(frozen=True)
class Spec:
    """One tensor to draw: normal(mean, std) of `shape`; float32 when `keep_float32`."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    keep_float32: bool = False


def tensor_specs(kind: str, shape: TinyShape, decisive: float = 1.0) -> list[Spec]:
    """Every tensor of the checkpoint, in HF names and layouts, per-expert for MoE;
    layers' output projections scaled by `decisive`."""
    h, head_dim = shape.hidden, shape.hidden // shape.heads

    def linear(name: str, rows: int, cols: int) -> Spec:
        output = name.endswith(("out_proj.weight", "w2.weight"))
        return Spec(name, (rows, cols), (decisive if output else 1.0) / math.sqrt(cols))

    def norm(name: str, size: int) -> Spec:
        return Spec(name, (size,), 0.1, mean=1.0)

    specs = [Spec("model.embed_tokens.weight", (shape.vocab, h), EMBEDDING_STD), norm("model.embedding_norm.weight", h)]
    for i, kind_i in enumerate(shape.layer_types()):
        p = f"model.layers.{i}."
        specs += [norm(p + "operator_norm.weight", h), norm(p + "ffn_norm.weight", h)]
        if kind_i == "conv":
            specs += [
                linear(p + "conv.in_proj.weight", 3 * h, h),
                Spec(p + "conv.conv.weight", (h, 1, shape.conv_kernel), 1 / math.sqrt(shape.conv_kernel)),
                linear(p + "conv.out_proj.weight", h, h),
            ]
        else:
            specs += [
                linear(p + "self_attn.q_proj.weight", shape.heads * head_dim, h),
                linear(p + "self_attn.k_proj.weight", shape.kv_heads * head_dim, h),
                linear(p + "self_attn.v_proj.weight", shape.kv_heads * head_dim, h),
                linear(p + "self_attn.out_proj.weight", h, shape.heads * head_dim),
                norm(p + "self_attn.q_layernorm.weight", head_dim),
                norm(p + "self_attn.k_layernorm.weight", head_dim),
            ]
        f = p + "feed_forward."
        if kind == "lfm2_moe" and i >= shape.dense_layers:
            specs += [linear(f + "gate.weight", shape.experts, h), Spec(f + "expert_bias", (shape.experts,), 0.1, keep_float32=True)]
            for e in range(shape.experts):
                specs += [
                    linear(f + f"experts.{e}.w1.weight", shape.expert_ffn, h),
                    linear(f + f"experts.{e}.w3.weight", shape.expert_ffn, h),
                    linear(f + f"experts.{e}.w2.weight", h, shape.expert_ffn),
                ]
        else:
            specs += [linear(f + "w1.weight", shape.ffn, h), linear(f + "w3.weight", shape.ffn, h), linear(f + "w2.weight", h, shape.ffn)]
    return specs


def tag_of(spec: Spec, dtype: str) -> str:
    """The safetensors dtype tag a tensor is stored with."""
    return "F32" if spec.keep_float32 else TAGS[dtype]


def nbytes_of(spec: Spec, tag: str) -> int:
    return math.prod(spec.shape) * MX_DTYPES[tag].size


def shard(specs: list[Spec], dtype: str) -> list[list[tuple[Spec, str]]]:
    """Consecutive specs grouped into shards of about SHARD_BYTES, each with its dtype tag."""
    shards, size = [[]], 0
    for spec in specs:
        tag = tag_of(spec, dtype)
        if shards[-1] and size + nbytes_of(spec, tag) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((spec, tag))
        size += nbytes_of(spec, tag)
    return shards


def write_shard(path: Path, entries: list[tuple[Spec, str]], progress) -> int:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes,
    offsets) first, then each tensor's bytes as soon as it is drawn."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec, tag in entries:
        size = nbytes_of(spec, tag)
        header[spec.name] = {"dtype": tag, "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for spec, tag in entries:
            tensor = mx.random.normal(spec.shape, dtype=MX_DTYPES[tag], loc=spec.mean, scale=spec.std)
            if tag != "F32":  # numpy has no bfloat16: write the raw 16-bit words
                tensor = tensor.view(mx.uint16)
            mx.eval(tensor)
            f.write(memoryview(tensor))
            progress(spec)
            del tensor
    return offset


def make_random_checkpoint(out: str | Path, preset: str, dtype: str = "bfloat16", seed: int = 0, decisive: float = 1.0) -> Path:
    kind, shape = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = target_config(kind, shape, dtype)
    config["block_dim"] = shape.hidden  # released config.json files carry it; mlx-lm requires it
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": [IM_END, EOS_TEXT], "pad_token_id": PAD}, indent=2) + "\n"
    )
    write_tokenizer(out, min(shape.vocab, TOKENIZER_VOCAB))

    mx.random.seed(seed)
    specs = tensor_specs(kind, shape, decisive)
    shards = shard(specs, dtype)
    total = sum(nbytes_of(s, t) for entries in shards for s, t in entries)
    print(f"{preset}: {len(specs)} tensors, {total / 1e9:.2f} GB in {len(shards)} shard(s) of {dtype} -> {out}", flush=True)
    start, written = time.perf_counter(), 0

    def progress(spec: Spec) -> None:
        nonlocal written
        before = written
        written += nbytes_of(spec, tag_of(spec, dtype))
        if written * 10 // total != before * 10 // total or written == total:
            print(f"  {written / 1e9:6.2f} / {total / 1e9:.2f} GB  {time.perf_counter() - start:6.1f} s  ({spec.name})", flush=True)

    weight_map, size = {}, 0
    for n, entries in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        size += write_shard(out / name, entries, progress)
        weight_map.update({spec.name: name for spec, _ in entries})
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TAGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decisive", type=float, default=1.0, help="scale of the layers' output projections (see above)")
    args = parser.parse_args()
    make_random_checkpoint(args.out, args.preset, args.dtype, args.seed, args.decisive)


if __name__ == "__main__":
    main()

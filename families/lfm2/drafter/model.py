"""The DSpark drafter's modules and weights (a small Qwen3-style backbone, the Markov and
confidence heads). The block is embedded with, and read out by, the target's tied table."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import attention_kernel, heads_kernel
from ..residual_kernel import add_norm
from ..cache import KVPool, RaggedLayout
from ..model import attend, heads_first, merge_parts, swiglu
from .config import DSparkConfig


class DSparkAttention(nn.Module):
    """GQA with per-head RMSNorm on q and k, then RoPE (interleaved pairing by default).
    The block's queries attend over the lane's context keys and the whole block."""

    by_kernel = False  # the block attended by `attention_kernel` (set by DSparkDrafter where it serves)
    heads_by_kernel = False  # q, k and v heads normed and rotated by `heads_kernel` (likewise)

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.rope_theta, self.rope_traditional = cfg.rope_theta, cfg.rope_traditional
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def rope(self, x: mx.array, offset) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=self.rope_traditional, base=self.rope_theta, scale=1.0, offset=offset)

    def merge_projections(self) -> None:
        """Serve q, k and v from one matmul `qkv_proj` (where they merge exactly)."""
        merge_parts(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """[N, T, H] -> q, k, v `[N, heads, T, D]`, q and k normed once the heads lead (no
        RoPE yet; why in that order: the target's `Attention.qkv`)."""
        n, t, _ = x.shape
        if "qkv_proj" in self:
            q_width = self.heads * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x), [q_width, q_width + self.kv_heads * self.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (heads_first(u.reshape(n, t, -1, self.head_dim)) for u in (q, k, v))
        return self.q_norm(q), self.k_norm(k), v

    def keys_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        """[N, T, H] rows at positions offset.. -> roped keys and values [N, kv_heads, T, D].
        Merged projections compute q too and drop it: one matmul beats two on these few rows."""
        if self.heads_by_kernel:  # serving: `offset` is each row's position, an array
            return self._heads(x, offset, want_q=False)[1:]
        _, k, v = self.qkv(x)
        return self.rope(k, offset), v

    def project(self, x: mx.array, layout: RaggedLayout) -> tuple[mx.array, mx.array, mx.array]:
        """Block rows `[N, g, H]` -> q, k, v `[N, heads, g, D]` at the block's positions."""
        if self.heads_by_kernel:
            return self._heads(x, layout.offsets_array)
        offset = layout.rope_offset()
        q, k, v = self.qkv(x)
        return self.rope(q, offset), self.rope(k, offset), v

    def _heads(self, x: mx.array, offsets: mx.array, want_q: bool = True) -> tuple[mx.array | None, mx.array, mx.array]:
        """`heads_kernel` over rows `[N, T, H]` at positions offsets[n] + t."""
        n, t, _ = x.shape
        return heads_kernel.project_heads(
            self.qkv_proj(x).reshape(n * t, -1), self.q_norm.weight, self.k_norm.weight, offsets, heads=self.heads,
            kv_heads=self.kv_heads, width=t, eps=self.q_norm.eps, base=self.rope_theta, traditional=self.rope_traditional,
            want_q=want_q)

    def core(self, q: mx.array, k: mx.array, v: mx.array, layout: RaggedLayout, slots: list[int], pool: KVPool, mask) -> mx.array:
        """The block's keys go to the pool just past the committed context (read this
        round only, overwritten by the next append); the block attends over the lane's
        context and itself."""
        pool.write(slots, layout, k, v)
        if self.by_kernel and attention_kernel.takes(layout.lanes, layout.width, layout.span):
            return attention_kernel.pool_attention(q, *pool.views(), layout.slot_ids(slots), layout.offsets_array, self.scale,
                                                   causal=False)
        keys, values = pool.read(slots, layout)
        return attend(q, keys, values, self.scale, mask)

    def finish(self, o: mx.array) -> mx.array:
        n, _, g, _ = o.shape
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(n, g, -1))


class DSparkMLP(nn.Module):
    """SwiGLU: `down(silu(gate x) * up x)`."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def merge_projections(self) -> None:
        """Serve gate and up from one matmul `gate_up_proj` (where they merge exactly)."""
        merge_parts(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            return self.down_proj(swiglu(*mx.split(self.gate_up_proj(x), 2, axis=-1)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DSparkAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = DSparkMLP(cfg.hidden_size, cfg.intermediate_size)

    def finish(self, h: mx.array, attended: mx.array, next_norm: nn.RMSNorm, by_kernel: bool) -> tuple[mx.array, mx.array]:
        """The rest of the layer once its attention core has run -> the residual rows and
        `next_norm` of them (the next layer's input norm, or the final one): each
        residual add goes with the norm after it (`add_norm`)."""
        h, normed = add_norm(h, self.self_attn.finish(attended), self.post_attention_layernorm, by_kernel)
        return add_norm(h, self.mlp(normed), next_norm, by_kernel)


class MarkovHead(nn.Module):
    """Rank-r token transitions: `w2(w1[prev])` is added to the base logits of the row
    that proposes the token after `prev`."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """`sigmoid(proj([h ; w1[prev]]))`: the chance a proposal survives given that the
    ones before it did."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.sigmoid(self.proj(x).astype(mx.float32)).squeeze(-1)


class DSparkModel(nn.Module):
    """The drafter's own weights. The target's table embeds the block and is its head."""

    def __init__(self, cfg: DSparkConfig, target_hidden: int):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DSparkLayer(cfg) for _ in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))

    def context(self, taps: mx.array) -> mx.array:
        """Taps [R, n_taps * H_target] -> context rows `hidden_norm(fc(taps))` [R, H]."""
        return self.hidden_norm(self.fc(taps))

"""Whether work runs on MLX's CUDA backend: where laneserve's own CUDA kernels
(`row_kernel`, `expert_kernel`, `conv_kernel`, `attention_kernel`, `heads_kernel`, the
drafter's greedy chain) can serve, and where the backend plans per shape (`cache.plans_per_shape`);
and how those kernels take a float as a template constant (`float_bits`)."""

from __future__ import annotations

import struct

import mlx.core as mx


def available() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def float_bits(value: float) -> int:
    """The float32 bits of `value`: how a kernel's template constant carries a float."""
    return struct.unpack("<i", struct.pack("<f", value))[0]

"""Tiny checkpoints made on the fly in the real on-disk formats, shared by the session; the CPU
in float32 for every test, the GPU for the CUDA kernel tests that ask for it."""

from __future__ import annotations

import atexit
import os
import sys

import mlx.core as mx
import pytest

from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("dense"), "lfm2", seed=1)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("moe"), "lfm2_moe", seed=2)


@pytest.fixture(scope="session")
def moe_fused_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("moe_fused"), "lfm2_moe", seed=2, expert_layout="fused")


@pytest.fixture(scope="session")
def drafter_dir(dense_dir, tmp_path_factory):
    """A DSpark drafter for `dense_dir` (a module that needs another shape defines its own)."""
    return make_tiny_drafter(tmp_path_factory.mktemp("drafter"), dense_dir, seed=5, block_size=9)


@pytest.fixture(scope="session")
def moe_drafter_dir(moe_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("moe_drafter"), moe_dir, seed=6, block_size=9)


@pytest.fixture(scope="session")
def wide_heads(tmp_path_factory):
    """A tiny target and drafter whose heads are 32 wide (the attention kernel takes multiples of 32)."""
    target = make_tiny_target(tmp_path_factory.mktemp("wide_target"), "lfm2", seed=3, shape=TinyShape(hidden=128))
    drafter = make_tiny_drafter(tmp_path_factory.mktemp("wide_drafter"), target, seed=4, block_size=9, head_dim=32)
    return target, drafter


@pytest.fixture(autouse=True, scope="session")
def _cpu_float32():
    # Tests run in float32 on the CPU: bf16 and quantized CPU kernels are slow, and
    # MoE gather_mm supports only float32 there.
    mx.set_default_device(mx.cpu)


@pytest.fixture
def on_gpu():
    """A CUDA kernel test's device (see tests/cuda.py), the CPU again after it."""
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(mx.cpu)


def pytest_sessionfinish(session, exitstatus):
    # MLX (0.32) can abort the interpreter at exit once arrays were evaluated on threads
    # other than the main one (ml-explore/mlx#3126), as the engine's are. Once Python's
    # own shutdown has begun (pytest has written its report by then), end the process
    # with pytest's status before C++ static destructors run.
    atexit.register(_exit_now, int(exitstatus))


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""The skip mark of the CUDA-only kernel tests (their `on_gpu` fixture is in conftest.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

needs_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")

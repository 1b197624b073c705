"""The MLX backend settings laneserve defaults (families/backend.py): set where missing,
never over a value the environment already holds, in place once `families` is imported."""

from __future__ import annotations

import os
import subprocess
import sys

from families.backend import BACKEND_DEFAULTS, apply_backend_defaults


def test_missing_settings_get_their_defaults():
    environ = {"PATH": "/bin"}
    assert apply_backend_defaults(environ) == BACKEND_DEFAULTS
    assert environ == {"PATH": "/bin", **BACKEND_DEFAULTS}


def test_a_value_already_set_wins():
    environ = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1", "MLX_USE_CUDA_GRAPHS": "1"}
    assert apply_backend_defaults(environ) == {}
    assert environ == {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1", "MLX_USE_CUDA_GRAPHS": "1"}


def test_cuda_graphs_are_off_unless_asked_for():
    environ = {"MLX_ENABLE_CACHE_THRASHING_CHECK": "1"}
    assert apply_backend_defaults(environ) == {"MLX_USE_CUDA_GRAPHS": "0"}


def test_importing_families_applies_them_before_anything_runs():
    env = {k: v for k, v in os.environ.items() if k not in BACKEND_DEFAULTS}
    script = "import os, families; print({k: os.environ.get(k) for k in %r})" % sorted(BACKEND_DEFAULTS)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(dict(sorted(BACKEND_DEFAULTS.items())))

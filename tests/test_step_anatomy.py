"""bench.step_anatomy as a user runs it (the `--kernels` part needs ncu and a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_step_anatomy_times_build_launch_and_wait(dense_dir, tmp_path):
    args = ["--model", str(dense_dir), "--out", str(tmp_path), "--lanes", "1,3", "--steps", "3", "--context", "24"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "bench.step_anatomy", *args], cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads((tmp_path / "step-anatomy.json").read_text())
    assert set(result["lanes"]) == {"1", "3"}
    for cell in result["lanes"].values():
        assert all(cell[part] > 0 for part in ("build_ms", "launch_ms", "wait_ms")) and "device" not in cell
    assert "| 3 |" in (tmp_path / "step-anatomy.md").read_text()

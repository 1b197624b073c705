"""Benchmarks: laneserve against mlx-lm side by side, load memory, random checkpoints of the real shapes."""

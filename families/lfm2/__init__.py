"""LiquidAI's LFM2 / LFM2.5 family: dense and MoE targets and their DSpark drafters."""

from .checkpoint import TargetCheckpoint, open_target
from .config import CheckpointError, Lfm2Config
from .loader import load_model
from .target import ContextLimitError, Lfm2Target
from .tokenizer import ChatTokenizer

__all__ = [
    "CheckpointError",
    "ChatTokenizer",
    "ContextLimitError",
    "Lfm2Config",
    "Lfm2Target",
    "TargetCheckpoint",
    "load_model",
    "open_target",
]

"""Opening a target checkpoint directory: model, tokenizer and stop ids together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import eos_ids_of
from .loader import load_model
from .target import Lfm2Target
from .tokenizer import ChatTokenizer


DEFAULT_DIR = Path(__file__).parent / "default"


def default_target_dir() -> Path:
    """The embedded default target: a small LFM2 trained by laneserve's own tools."""
    return DEFAULT_DIR / "target"


def default_drafter_dir() -> Path:
    """The embedded default target's DSpark drafter."""
    return DEFAULT_DIR / "drafter"


@dataclass
class TargetCheckpoint:
    path: Path
    target: Lfm2Target
    tokenizer: ChatTokenizer
    eos_ids: tuple[int, ...]


def open_target(path: str | Path, dtype: str | None = None, max_lanes: int = 16, by_rows: bool | None = None) -> TargetCheckpoint:
    """`by_rows`: see Lfm2Target."""
    model, config = load_model(path, dtype=dtype)
    tokenizer = ChatTokenizer(path)
    return TargetCheckpoint(Path(path), Lfm2Target(model, config, max_lanes, by_rows=by_rows), tokenizer,
                            eos_ids_of(path, config, tokenizer.token_to_id))

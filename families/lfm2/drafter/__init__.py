"""LiquidAI's DSpark drafter for LFM2 targets, in MLX.

A small Qwen3-style backbone reads the target's residual streams after a few layers (the
taps), drafts a whole block `[anchor] + [mask] * (g - 1)` in one forward, and turns it
into a chain of g proposals with a low-rank Markov token-transition head; a confidence
head says how likely each proposal is to survive verification. It has no embedding and
no head of its own: both are the target's tied table.

Split like the target: `config` (config.json and the pairing with a target), `model`
(the modules and weights), `runtime` (`DSparkDrafter`: each lane's context K/V in slot
pools, appended only with committed rows; one batched proposal for many lanes), `chain`
(a greedy proposal's Markov chain as one CUDA kernel, for small heads), `load` (a
directory to a runtime).
"""

from .config import MAX_VERIFY_WIDTH, DSparkConfig, check_pairing
from .load import load_drafter
from .model import DSparkModel
from .runtime import DraftError, DSparkDrafter, Proposal, validate_proposal

__all__ = [
    "MAX_VERIFY_WIDTH",
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkModel",
    "DraftError",
    "Proposal",
    "check_pairing",
    "load_drafter",
    "validate_proposal",
]

"""Write the committed parity references in tests/references/ (needs the `reference` extra).

For each of a dense LFM2 and an LFM2-MoE, at tiny sizes: the weights of a tiny checkpoint
are loaded into transformers' own `Lfm2ForCausalLM` / `Lfm2MoeForCausalLM` and saved by
its `save_pretrained` in float32 (so the directory is in transformers' on-disk format:
its config keys, its conv layout, transformers 5's fused expert tensors), then
transformers computes a greedy continuation of a fixed prompt and the logits of every
row. tests/test_lfm2_parity.py checks laneserve against these files without torch.

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    pip install -e ".[cpu,test,reference]"
    python tests/make_references.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from families.lfm2.tiny import TinyShape, make_tiny_target  # noqa: E402

REFERENCES = Path(__file__).parent / "references"
# Small enough that both checkpoints and their logits stay well under 2 MB, with every
# operator present: conv and attention layers (GQA), dense and routed FFN layers.
SHAPES = {
    "lfm2": TinyShape(vocab=320, hidden=32, layers=5, heads=4, kv_heads=2, ffn=64, attention=(1, 3)),
    "lfm2_moe": TinyShape(vocab=320, hidden=32, layers=5, heads=4, kv_heads=2, ffn=64, experts=4, experts_per_token=2,
                          expert_ffn=16, dense_layers=1, attention=(1, 3)),
}
# Fields the tiny maker leaves at their defaults, set to other values here so parity covers them.
CONFIG_OVERRIDES = {"lfm2": {}, "lfm2_moe": {"routed_scaling_factor": 1.5}}
PROMPT_LENGTH = 40
STEPS = 24


def prompt_for(vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(15, vocab, PROMPT_LENGTH)]


def reference_run(path: str | Path, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy continuation of `prompt` (a full forward per step, no cache)
    and its float32 logits for every row of prompt + continuation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens])).logits[0].numpy()
    return tokens[len(prompt):], logits


def write_reference(kind: str, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        # transformers 5 holds experts fused and saves them in the layout it read: start fused.
        source = make_tiny_target(Path(scratch) / kind, kind, seed=5, shape=SHAPES[kind], expert_layout="fused")
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, **CONFIG_OVERRIDES[kind]}))
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
    prompt = prompt_for(SHAPES[kind].vocab)
    greedy, logits = reference_run(out, prompt, STEPS)
    np.save(out / "logits.npy", logits)  # .npy, not .npz: a zip stamps the time, so reruns would differ
    (out / "reference.json").write_text(json.dumps({
        "made_by": "python tests/make_references.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "architecture": type(model).__name__,
        "prompt": prompt,
        "greedy": greedy,
    }, indent=1) + "\n")


def main() -> None:
    for kind in SHAPES:
        write_reference(kind, REFERENCES / kind)
        print(f"{REFERENCES / kind}: {sum(f.stat().st_size for f in (REFERENCES / kind).iterdir()) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()

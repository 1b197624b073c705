"""Accepted drafts per drafted round at fixed width 9 on the embedded default, sampled at
T = 0.7 and 1.0 over the held-out prompts (seeds 1000 + i), for the lane core on
PYTHONPATH: run it on a checkout before 2551cdb (speculative rejection sampling) and at or
after it (Gumbel-max coupling) to compare the two acceptance rules.

    python -m bench.sampling_acceptance
"""
import json
from pathlib import Path

import mlx.core as mx

mx.set_default_device(mx.cpu)
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir
from families.lfm2.drafter import load_drafter
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams

prompts = json.loads(Path(__file__).with_name("default_prompts.json").read_text())["prompts"]
loaded = open_target(default_target_dir(), dtype="float32", max_lanes=16)
drafter = load_drafter(default_drafter_dir(), loaded.target.model, loaded.target.config, dtype="float32", max_lanes=16)
engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=16, draft_width=9))
def ids(p):
    return loaded.tokenizer.encode_chat([{"role": "user", "content": p["chat"]}]) if "chat" in p else loaded.tokenizer.encode(p["text"])
out = {}
for t in (0.7, 1.0):
    done = []
    for start in range(0, len(prompts), 16):
        done += engine.generate([Request(ids(p), 48, SamplingParams(temperature=t, seed=1000 + i)) for i, p in enumerate(prompts[start:start+16], start)])
    rounds = sum(d.draft.drafted_rounds for d in done); acc = sum(d.draft.accepted for d in done)
    out[t] = {"drafted_rounds": rounds, "accepted": acc, "accepted_per_drafted_round": round(acc / rounds, 3)}
print(json.dumps(out))

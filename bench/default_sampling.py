"""Which sampling settings read best on the embedded default: loops against coherence.

    python -m bench.default_sampling --corpus ../shared/corpus --out bench/results/cpu-default

On the held-out prompts of bench/default_prompts.json, each setting of the grid
(temperature x repetition penalty x min_p x top_p) answers every prompt with two seeds,
up to --max-tokens. Each reply is scored by

- rep4: the share of its 4-grams of tokens that already occurred earlier in it (a loop
  repeats nearly all of them; greedy replies of this model loop);
- looping: whether some 4-gram occurs 4 or more times;
- distinct2: distinct bigrams over bigrams;
- nll: its mean negative log-likelihood per token under the target at temperature 1,
  unfiltered, after its prompt (high: the text wanders off into noise).

The same scores of the held-out text that really follows each prompt in the corpus
(the paragraph's continuation; the dictionary's definition for a chat prompt) are the
reference. The chosen setting is the most coherent one that loops no more than that
text: the lowest nll among settings whose share of looping replies is at most the
reference's (or, if none manages that, at most the least of any setting). Writes
sampling.json and sampling.md under --out, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx

from bench.bench_default import PROMPTS, encode
from bench.provenance import markdown_line, provenance, write_result
from families.lfm2 import open_target
from families.lfm2.checkpoint import default_target_dir
from families.lfm2.train.corpus import chat_text, documents
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams

SEEDS = (1000, 2000)


def rep4(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def looping(ids: list[int]) -> bool:
    counts = Counter(tuple(ids[i : i + 4]) for i in range(len(ids) - 3))
    return bool(counts) and max(counts.values()) >= 4


def distinct2(ids: list[int]) -> float:
    grams = [tuple(ids[i : i + 2]) for i in range(len(ids) - 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def nll(model, prompt: list[int], reply: list[int]) -> float:
    """Mean -log p(reply token | everything before it) under the target, temperature 1."""
    seq = mx.array([prompt + reply])
    h, _ = model(seq[:, :-1])
    logits = model.head(h).astype(mx.float32)[0, len(prompt) - 1 :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, mx.array(reply)[:, None], axis=-1).mean().item()


def scores(model, prompt: list[int], reply: list[int]) -> dict:
    return {"rep4": rep4(reply), "looping": looping(reply), "distinct2": distinct2(reply), "nll": nll(model, prompt, reply)}


def summary(rows: list[dict]) -> dict:
    return {
        "rep4": statistics.mean(r["rep4"] for r in rows),
        "looping": statistics.mean(float(r["looping"]) for r in rows),
        "distinct2": statistics.mean(r["distinct2"] for r in rows),
        "nll": statistics.mean(r["nll"] for r in rows),
        "tokens": statistics.mean(r["tokens"] for r in rows),
        "replies": len(rows),
    }


def references(corpus: Path, prompts: list[dict]) -> list[str | None]:
    """The held-out text that follows each prompt in the corpus, or None where not found."""
    texts = [d.text for d in documents(corpus, "eval")]
    found = []
    for p in prompts:
        if "chat" in p:
            head = chat_text(p["chat"], "").removesuffix("<|im_end|>\n")
            match = next((t for t in texts if t.startswith(head)), None)
            found.append(match[len(head) :].split("<|im_end|>")[0] if match else None)
        else:
            match = next((t for t in texts if p["text"] in t), None)
            found.append(match[match.index(p["text"]) + len(p["text"]) :] if match else None)
    return found


def grid(args) -> list[SamplingParams]:
    settings = []
    for t, rp, min_p, top_p in itertools.product(args.temperatures, args.penalties, args.min_p, args.top_p):
        if t == 0 and (min_p, top_p) != (args.min_p[0], args.top_p[0]):
            continue  # greedy ignores the filters: one of each penalty is enough
        settings.append(SamplingParams(temperature=t, top_p=top_p, min_p=min_p if t else 0.0, repetition_penalty=rp))
    return settings


def label(s: SamplingParams) -> str:
    return f"T={s.temperature:g} rp={s.repetition_penalty:g} min_p={s.min_p:g} top_p={s.top_p:g}"


def run(args) -> dict:
    loaded = open_target(args.model, dtype="float32", max_lanes=16)
    model, tokenizer = loaded.target.model, loaded.tokenizer
    held_out = json.loads(PROMPTS.read_text())["prompts"]
    prompts = [encode(tokenizer, p) for p in held_out]
    engine = Engine(loaded.target, tokenizer, loaded.eos_ids, None, EngineConfig(max_streams=16, max_waiting=2 * 64))
    result = {"model": str(args.model), "prompts": len(prompts), "seeds": list(SEEDS), "max_tokens": args.max_tokens, "settings": []}
    if args.corpus:
        rows = []
        for prompt, text in zip(prompts, references(Path(args.corpus), held_out)):
            if text:
                reply = tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
                rows.append({**scores(model, prompt, reply), "tokens": len(reply)})
        result["reference"] = summary(rows)
        print(f"reference (held-out text): {result['reference']}", flush=True)
    for setting in grid(args):
        requests = [Request(p, args.max_tokens, sampling=replace(setting, seed=seed + i), draft=False)
                    for seed in SEEDS for i, p in enumerate(prompts)]
        done = engine.generate(requests)
        rows = [{**scores(model, r.prompt, d.token_ids), "tokens": len(d.token_ids)} for r, d in zip(requests, done) if d.token_ids]
        entry = {"setting": {k: v for k, v in asdict(setting).items() if k != "seed"}, **summary(rows),
                 "examples": [tokenizer.decode(d.token_ids) for d in done[: len(prompts) : 9]]}
        result["settings"].append(entry)
        print(f"{label(setting)}: rep4 {entry['rep4']:.3f} looping {entry['looping']:.2f} distinct2 {entry['distinct2']:.3f} "
              f"nll {entry['nll']:.3f} tokens {entry['tokens']:.1f}", flush=True)
    # Loop no more than the held-out text, or, where no setting manages that, no more than the best one.
    limit = max(result["reference"]["looping"] if "reference" in result else 0.0, min(e["looping"] for e in result["settings"]))
    eligible = [e for e in result["settings"] if e["looping"] <= limit]
    result["chosen"] = min(eligible, key=lambda e: e["nll"])["setting"]
    return result


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             (f"{result['prompts']} held-out prompts x {len(result['seeds'])} seeds, up to {result['max_tokens']} tokens; "
             "rep4: repeated 4-grams; looping: replies with a 4-gram seen 4+ times; nll: nats per token under the target."), "",
             "| setting | rep4 | looping | distinct2 | nll | tokens |", "|---|---:|---:|---:|---:|---:|"]
    if "reference" in result:
        r = result["reference"]
        lines.append(f"| held-out text ({r['replies']} prompts) | {r['rep4']:.3f} | {r['looping']:.2f} | {r['distinct2']:.3f} | {r['nll']:.3f} | {r['tokens']:.1f} |")
    for e in result["settings"]:
        s = SamplingParams(**e["setting"])
        mark = " **chosen**" if e["setting"] == result["chosen"] else ""
        lines.append(f"| {label(s)}{mark} | {e['rep4']:.3f} | {e['looping']:.2f} | {e['distinct2']:.3f} | {e['nll']:.3f} | {e['tokens']:.1f} |")
    chosen = next(e for e in result["settings"] if e["setting"] == result["chosen"])
    lines += ["", f"Chosen: {label(SamplingParams(**result['chosen']))}. Replies to every ninth prompt (first seed):", ""]
    lines += [f"- {json.dumps(text)}" for text in chosen["examples"]]
    return "\n".join(lines) + "\n"


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_target_dir())
    p.add_argument("--corpus", help="the corpus directory, for the held-out reference text")
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperatures", type=floats, default=floats("0,0.3,0.5,0.7,0.9"))
    p.add_argument("--penalties", type=floats, default=floats("1,1.1,1.2,1.3"))
    p.add_argument("--min-p", type=floats, default=floats("0.05"))
    p.add_argument("--top-p", type=floats, default=floats("1"))
    args = p.parse_args()
    result = {**provenance(), **run(args)}
    write_result(args.out, "sampling", result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()

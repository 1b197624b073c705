"""The engine's rounds under several settings of MLX's backend, side by side: each
setting in a process of its own, the processes taking turns on the same machine.

    python -m bench.backend_settings --model DIR --drafter DIR --out DIR
        [--settings 'default;MLX_USE_CUDA_GRAPHS=1;code=.device/code-e8021da'] [--streams 1,16]
        [--gen-tokens 1024] [--alternations 5] [--name backend-settings]

MLX's CUDA backend reads its settings from the environment once, when it first runs, so
one process cannot try two of them. On the H200 every round is bound by the host's time
per operation (DESIGN.md, bench/results/README.md), and much of that time is how the
backend hands kernels to the device: it records them into CUDA graphs of up to
`MLX_MAX_OPS_PER_BUFFER` operations and `MLX_MAX_MB_PER_BUFFER` of inputs (100 and
1000 on Hopper, the latter counted in millions of elements), then updates a cached
executable of the same topology and launches it. CUPTI counts of the engine's rounds put
cudaGraphLaunch and cudaGraphExecUpdate at about half of the host's CUDA API time
(`gpu/session16/kernels-dc633b9/`). `MLX_USE_CUDA_GRAPHS=0` launches each kernel
directly instead, and since session 33 is laneserve's default (families/backend.py);
other sizes of graph trade launches against updates. The settings tried by default are
DEFAULT_SETTINGS.

A setting is `default` (the environment as it is, with families' backend defaults) or
`NAME=VALUE[,NAME=VALUE...]` of `MLX_*` variables, given to its process only, and of
`code=DIR`: the process runs the laneserve code in DIR instead of this checkout's (an
earlier commit's tree, `bench.export_code`), so that a change to the code is measured
beside the code before it, as a setting is; the first setting is the reference.
`control` runs the reference's setting again in a process of its own: what two
processes of the same code and setting differ by is the floor under every other ratio
(on a shared GPU, processes started side by side need not run alike).

Every process loads the same checkpoint (the target made
decisive as in `bench_engine`), records the plain engine's greedy continuation of the
same prompts, and wraps the drafter in the scripted-acceptance drafter at the published
profile. Then, for each alternation and each cell (a stream count and an engine, plain
or drafted), every setting runs the cell once, in an order that rotates from one
alternation to the next. Each run is `bench_engine.decode_run`: aggregate tokens per
second while every lane decodes, and the mean round time from the engine's counters.
Reported per cell and setting: tok/s; the mean round of the engine's own kind (plain
rounds of the plain engine, drafted ones of the drafting engine, whose guard may run a
few plain), with a drafted round's draft phase (the host building and launching the
drafter's work) and the share of rounds of that kind; the ratio to the reference's run
of the same cell in the same alternation, and drafted / plain within the setting;
medians and [min-max] over alternations; for drafted cells also drafted / plain until the
run's first lane ends and the share of the run after it (its tail, as `bench_engine`
reports them). `same tokens` says every run at that stream
count, plain and drafted, under every setting, emitted what the reference's first plain
run did (a setting that changes which kernels run could move a near-tie; drafted runs
must equal plain ones). NAME.json and NAME.md (under --out, with the command, commit and
machine) are written after every alternation, so a run cut short keeps what it finished;
a setting whose process ends, or gives no answer within `--load-timeout` seconds of
starting or `--cell-timeout` of being asked for a cell (it is then stopped), is named
with the reason and left out from then on, and the command then exits non-zero.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.export_code import COMMIT_FILE
from bench.provenance import markdown_line, median_range, provenance, spread, write_result

ENGINES = ("plain", "drafted")
CONTROL = "control"  # the reference's setting, in a second process
# The reference (kernels launched one by one); MLX's own default, CUDA graphs; graphs of
# up to 200 operations, whatever their inputs (a 2.6B step reads about 2.6G elements:
# 1000 would commit a graph three times a step besides the operation count). Three, so
# that a run of the 2.6B shape (about 3 minutes to start the processes, 15 s a setting
# an alternation) fits one 10-minute call of the GPU machine.
DEFAULT_SETTINGS = ("default", "MLX_USE_CUDA_GRAPHS=1",
                    "MLX_USE_CUDA_GRAPHS=1,MLX_MAX_OPS_PER_BUFFER=200,MLX_MAX_MB_PER_BUFFER=1000000")


@dataclass(frozen=True)
class Setting:
    """What one process runs under: MLX variables added to its environment, and the
    checkout whose code it runs (None: this one)."""

    env: dict[str, str] = field(default_factory=dict)
    code: str | None = None


def parse_setting(text: str) -> Setting:
    """`default` -> Setting(); `MLX_A=1,code=DIR` -> Setting({"MLX_A": "1"}, "DIR"): names
    of MLX's variables, and at most one `code`, a directory holding this benchmark."""
    text = text.strip()
    if text == "default":
        return Setting()
    env, code = {}, None
    for part in text.split(","):
        name, equals, value = part.strip().partition("=")
        if name == "code" and equals and value and code is None:
            if not (Path(value) / "bench" / "backend_settings.py").is_file():
                raise ValueError(f"setting {text!r}: {value} holds no laneserve code with bench/backend_settings.py")
            code = value
        elif equals and value and name.startswith("MLX_"):
            env[name] = value
        else:
            raise ValueError(f"setting {text!r}: each part must be MLX_NAME=VALUE or one code=DIR, not {part.strip()!r}")
    return Setting(env, code)


def code_commit(code: str) -> str:
    """The commit a code directory holds: its COMMIT file (`bench.export_code` writes
    one), else its git HEAD, else unknown."""
    named = Path(code) / COMMIT_FILE
    if named.is_file():
        return named.read_text().strip()
    try:
        return subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tokens_digest(tokens: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def cells(streams: list[int]) -> list[tuple[int, str]]:
    return [(n, engine) for n in streams for engine in ENGINES]


def turn_order(count: int, alternation: int) -> list[int]:
    """The settings' order in one alternation: rotated by one each time, so that none
    always runs first (after another setting's run) or last."""
    return [(alternation + i) % count for i in range(count)]


# -- the worker: one setting's process --------------------------------------------------

def serve_cells(args) -> None:
    """Load, record, build both engines, say `ready`, then run cells asked for on stdin
    (one JSON line each) and answer on stdout, until stdin closes. Everything else the
    process prints goes to stderr, so stdout carries the answers alone."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import numpy as np

    from bench.bench_engine import Setup, decode_run
    from bench.scripted import published_profile

    began = time.perf_counter()
    setup = Setup(args, max(args.streams))
    rng = np.random.default_rng(0)
    prompts = {n: setup.prompts(rng, n, args.prompt_tokens) for n in args.streams}
    recorded = {n: decode_run(setup.plain, ps, args.gen_tokens)["tokens"] for n, ps in prompts.items()}
    engines = {"plain": setup.plain,
               "drafted": setup.scripted(published_profile(), [p + t for n in args.streams for p, t in zip(prompts[n], recorded[n])])}
    answers.write(json.dumps({"ready": True, "seconds": time.perf_counter() - began, "code_dir": str(Path(__file__).parent.parent),
                              "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}}) + "\n")
    for line in iter(sys.stdin.readline, ""):
        ask = json.loads(line)
        engine = engines[ask["engine"]]
        before = engine.rounds.counters.snapshot()
        run = decode_run(engine, prompts[ask["streams"]], args.gen_tokens)
        tail = {key: run[key] for key in ("full_tok_s", "tail_seconds_share") if key in run}  # code before 4549e85 has none
        answers.write(json.dumps({"tok_s": run["tok_s"], "seconds": run["seconds"], "digest": tokens_digest(run["tokens"]),
                                  **tail, **round_times(before, engine.rounds.counters.snapshot(), ask["engine"])}) + "\n")


def round_times(before: dict, after: dict, mode: str) -> dict:
    """From two `RoundCounters` snapshots: the mean round of `mode` (the engine's own:
    plain rounds of the plain engine, drafted ones of the drafting engine, whose guard may
    run a few plain), its drafted rounds' draft phase, and the share of rounds in `mode`."""
    grown = lambda key, m: after[key].get(m, 0) - before[key].get(m, 0)
    rounds = grown("rounds_by_mode", mode)
    everything = sum(grown("rounds_by_mode", m) for m in ("plain", "drafted"))
    drafted = grown("rounds_by_mode", "drafted")
    return {"round_ms": 1e3 * grown("seconds_by_mode", mode) / rounds if rounds else None, "mode_share": rounds / max(everything, 1),
            "draft_ms": 1e3 * (after["draft_seconds"] - before["draft_seconds"]) / drafted if drafted else None}


# -- the parent: settings taking turns --------------------------------------------------

class Worker:
    """One setting's process and its line protocol."""

    def __init__(self, label: str, setting: Setting, args):
        self.label = label
        self.silent_for: float | None = None  # set when the process is stopped for giving no answer
        forwarded = ["--model", os.path.abspath(args.model), "--drafter", os.path.abspath(args.drafter),
                     "--streams", ",".join(map(str, args.streams)), "--prompt-tokens", str(args.prompt_tokens),
                     "--gen-tokens", str(args.gen_tokens), "--decisive", repr(args.decisive),
                     *(["--dtype", args.dtype] if args.dtype else [])]
        env = {**os.environ, **setting.env}
        if setting.code:  # its own code first on the path, and its own commit in what it records
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(setting.code), env.get("PYTHONPATH")]))
            env["BENCH_COMMIT"] = code_commit(setting.code)
        self.process = subprocess.Popen([sys.executable, "-m", "bench.backend_settings", "--worker", *forwarded],
                                        cwd=setting.code, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def answer(self, timeout: float) -> dict | None:
        """The process's next answer; None once it has ended (its output went to stderr)
        or, stopped, when it gave none within `timeout` seconds (a hung backend must not
        cost the other settings the rest of the run)."""
        if not select.select([self.process.stdout], [], [], timeout)[0]:
            self.process.kill()
            self.silent_for = timeout
            return None
        line = self.process.stdout.readline()
        return json.loads(line) if line else None

    def ask(self, streams: int, engine: str, timeout: float) -> dict | None:
        try:
            self.process.stdin.write(json.dumps({"streams": streams, "engine": engine}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        return self.answer(timeout)

    def ended(self, doing: str) -> str:
        status = self.process.wait()
        if self.silent_for is not None:
            return f"its process gave no answer within {self.silent_for:g} s {doing} and was stopped"
        return f"its process ended with exit status {status} {doing}; its output is above"

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        self.process.wait()


def summarize(labels: list[str], streams: list[int], runs: dict) -> dict:
    """`runs[(n, engine, label)]`: that cell's answers, one per alternation, in order."""
    reference = labels[0]
    summary = {}
    for n, engine in cells(streams):
        first = runs[(n, "plain", reference)][0]["digest"]
        same = all(r["digest"] == first for label in labels for e in ENGINES for r in runs[(n, e, label)])
        row = {"same_tokens": same, "settings": {}}
        for label in labels:
            mine = runs[(n, engine, label)]
            entry = {"tok_s": spread([r["tok_s"] for r in mine]), "mode_share": spread([r["mode_share"] for r in mine]),
                     "tok_s_runs": [r["tok_s"] for r in mine]}
            for key in ("round_ms", "draft_ms"):  # over the runs that had such rounds
                measured = [r[key] for r in mine if r[key] is not None]
                if measured:
                    entry[key] = spread(measured)
            if label != reference:
                entry["vs_reference"] = spread([r["tok_s"] / ref["tok_s"] for r, ref in zip(mine, runs[(n, engine, reference)])])
            if engine == "drafted":
                entry["vs_plain"] = spread([d["tok_s"] / p["tok_s"] for d, p in zip(mine, runs[(n, "plain", label)])])
                if all("full_tok_s" in d for d in mine):  # until a lane ends, and the tail after (bench_engine.decode_run)
                    entry["vs_plain_until_a_lane_ends"] = spread([d["full_tok_s"] / p["tok_s"]
                                                                  for d, p in zip(mine, runs[(n, "plain", label)])])
                    entry["tail_share"] = spread([d["tail_seconds_share"] for d in mine])
            row["settings"][label] = entry
        summary[f"{n} {engine}"] = row
    return summary


def run(args, saved=lambda result: None) -> dict:
    """Every setting's cells, alternation after alternation; `saved(result)` after each,
    so a run cut short keeps its finished alternations. A setting whose process ends is
    reported under `failed` and left out from then on (all of it, if it is the reference)."""
    labels = [text.strip() for text in args.settings.split(";") if text.strip()]
    if labels[:1] == [CONTROL]:
        raise ValueError(f"{CONTROL!r} repeats the reference, so it cannot be the first setting")
    settings = {label: parse_setting(labels[0] if label == CONTROL else label) for label in labels}
    if len(settings) != len(labels):
        raise ValueError(f"a setting is named twice in {args.settings!r}")
    result = {**provenance(), "model": args.model, "drafter": args.drafter, "dtype": args.dtype or "as stored",
              "decisive": args.decisive, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "alternations": args.alternations, "streams": args.streams, "settings": labels, "workers": {},
              "failed": {}, "alternations_done": 0, "cells": {}}
    # The first process alone, so that whatever it compiles and caches on disk is there
    # before the others start; then the others together.
    workers = {labels[0]: Worker(labels[0], settings[labels[0]], args)}
    ready = {labels[0]: workers[labels[0]].answer(args.load_timeout)}
    workers.update({label: Worker(label, settings[label], args) for label in labels[1:]})
    live = []
    try:
        for label in labels:
            answer = ready[label] if label in ready else workers[label].answer(args.load_timeout)
            if answer is None:
                result["failed"][label] = workers[label].ended("while loading")
                continue
            print(f"{label}: ready in {answer['seconds']:.1f} s", flush=True)
            code = settings[label].code
            result["workers"][label] = {**answer, "code": code or ".", "commit": code_commit(code) if code else result["commit"]}
            live.append(label)
        runs = {(n, engine, label): [] for n, engine in cells(args.streams) for label in labels}
        for alternation in range(args.alternations):
            if not live or live[0] != labels[0]:
                break  # the reference is gone: nothing left to compare with
            for n, engine in cells(args.streams):
                for label in (live[i] for i in turn_order(len(live), alternation)):
                    if label in result["failed"]:
                        continue
                    answer = workers[label].ask(n, engine, args.cell_timeout)
                    if answer is None:
                        result["failed"][label] = workers[label].ended(f"in alternation {alternation + 1} ({n} streams, {engine})")
                        continue
                    runs[(n, engine, label)].append(answer)
                    rounds = "" if answer["round_ms"] is None else f", {engine} rounds of {answer['round_ms']:.2f} ms"
                    print(f"alternation {alternation + 1}: {n} streams, {engine}, {label}: {answer['tok_s']:.1f} tok/s{rounds}",
                          flush=True)
            live = [label for label in live if label not in result["failed"]]
            if live and live[0] == labels[0]:
                result["alternations_done"] = alternation + 1
                result["cells"] = summarize(live, args.streams, runs)
            saved(result)
    finally:
        for worker in workers.values():
            worker.close()
    saved(result)  # also when no alternation finished: what failed is in it
    return result


def markdown(result: dict) -> str:
    reference = result["settings"][0]
    lines = [markdown_line(result),
             (f"- dtype {result['dtype']}, target made decisive by {result['decisive']:g}; prompts of {result['prompt_tokens']} "
              f"tokens, {result['gen_tokens']} generated per stream, {result['alternations_done']} of {result['alternations']} "
              "alternations done; drafted: scripted "
              f"acceptance at the published profile. Each setting in its own process; the reference is `{reference}`. "
              "Medians [min-max] over alternations; ratios are taken within an alternation."),
             *(f"- `{label}` ran the code of commit {worker['commit']}" for label, worker in result["workers"].items()
               if worker.get("code", ".") != "."),
             *(f"- failed: `{label}`: {why}" for label, why in result["failed"].items()),
             "", ("| streams | engine | setting | tok/s | round ms | of which drafting | rounds of its kind | vs reference | drafted / plain "
                  "| until a lane ends | tail | same tokens |"),
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for key, row in result["cells"].items():
        n, engine = key.split()
        for label, entry in row["settings"].items():
            tok_s = median_range(entry["tok_s"], 1)
            vs_reference = median_range(entry["vs_reference"], unit="x") if "vs_reference" in entry else "-"
            vs_plain = median_range(entry["vs_plain"], unit="x") if "vs_plain" in entry else "-"
            until = median_range(entry["vs_plain_until_a_lane_ends"], unit="x") if "vs_plain_until_a_lane_ends" in entry else "-"
            tail = median_range(entry["tail_share"], 0, percent=True) if "tail_share" in entry else "-"
            round_ms, drafting = (median_range(entry[key]) if key in entry else "-" for key in ("round_ms", "draft_ms"))
            lines.append(f"| {n} | {engine} | `{label}` | {tok_s} | {round_ms} | {drafting} | "
                         f"{entry['mode_share']['median']:.0%} | {vs_reference} | {vs_plain} | {until} | {tail} | {row['same_tokens']} |")
    lines += ["", ("Until a lane ends: a drafted run's tok/s up to its first lane's end over the plain run's; tail: the share "
                   "of the drafted run after it, where lanes that drifted apart end one by one (code before 4549e85: '-').")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", help="where NAME.json and NAME.md go (required unless --worker)")
    p.add_argument("--name", default="backend-settings", help="base name of the result files")
    p.add_argument("--settings", default=";".join(DEFAULT_SETTINGS),
                   help="';'-separated settings, the first the reference (see above)")
    p.add_argument("--streams", type=ints, default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=1024)
    p.add_argument("--alternations", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--decisive", type=float, default=1 / 32, help="as bench_engine's")
    p.add_argument("--load-timeout", type=float, default=420.0,
                   help="seconds a setting's process may take to load, record and warm up before it is stopped")
    p.add_argument("--cell-timeout", type=float, default=180.0,
                   help="seconds a setting's process may take to answer one cell before it is stopped")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.streams or min(args.streams) < 1:
        p.error("--streams needs stream counts of at least 1")
    if args.alternations < 1:
        p.error("--alternations must be at least 1")
    if args.worker:
        serve_cells(args)
        return
    if not args.out:
        p.error("--out is required")
    try:
        result = run(args, lambda result: write_result(args.out, args.name, result, markdown(result)))
    except ValueError as e:
        p.error(str(e))
    print(markdown(result))
    if result["failed"]:
        raise SystemExit(f"backend_settings: {len(result['failed'])} setting(s) failed: "
                         + "; ".join(f"{label}: {why}" for label, why in result["failed"].items()))


if __name__ == "__main__":
    main()

"""What one plain decode step and one drafting round cost, and how many operations they issue.

    python -m bench.bench_step [--model DIR --drafter DIR] [--dtype float32] [--lanes 1,8,16] [--seconds 2] [--read ROWS]

Defaults to the embedded default target and drafter. For each lane count, after every
lane has read a random prompt of `--context` tokens:

- plain step: one target forward with one row per lane, fed the previous step's lazy
  argmax, the taps a drafter reads, argmax, commit; pipelined as the engine runs plain
  rounds (each step launched before the one before it is read);
- drafting round: one committed row per lane appended to the drafter's context, then a
  greedy proposal of the drafter's width per lane as the engine asks for one (no chain
  logits; no confidences where shapes are steady, as on CUDA), evaluated with the context it wrote; with `--chain-ops` also the same round
  with the chain as MLX operations (`draft-ops`) where it otherwise runs as one kernel;
- prompt reads (`--read ROWS`): as many lanes as the cell's, on slots past the decoding
  lanes' (as a lane joining takes an ended lane's slot), each reading a prompt chunk of
  ROWS tokens in one steady forward with the drafter's taps, the engine's prompt read,
  never committed: `read` compiled as the engine runs it, `read-eager` not;
- peer step (`--peer`): one `next_generated` call of mlx-lm's BatchGenerator holding
  the same number of sequences, on the same checkpoint, in the same process.

`--slot-gap` also times each lane count's lanes in slots that do not start at 0 (names
ending `@gap`), as a batch's tail leaves them once lanes have ended out of turn: the
target's compiled segments then take the slots as an array (gathered and scattered)
where slots 0..N-1 are read as views. `--families` names copies of the families package
to compare in one process (an earlier
commit's copy importable under another name, e.g. `base_families`); `--reserve N` also
times a plain step of one lane and of the most lanes with the KV pools grown to N
positions per slot (a pool copied per step instead of updated in place shows as a
slower step).

Each is run for `--seconds`, in turns (`--turns`, the systems alternate within a turn),
and reported as the median milliseconds of its steps with the spread of the turns'
medians. `build ms` is the median host time of making a step's lazy graph, before any of
it is evaluated (Python, and the calls into compiled segments, which replay their traced
graphs), over 20 builds. `ops` counts the primitives in one step's graph once warm (as `mx.export_to_dot` sees
them: under `mx.compile` a fused elementwise chain is one); `kernels` leaves out the
ones that only make views (reshape, slice, broadcast, ...), which launch nothing; the
JSON keeps the count of each primitive by name (`op_names`), where a graph's host time goes.
Writes NAME.json and NAME.md under --out when given, each with its command, commit and
machine.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import re
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.provenance import markdown_line, provenance, write_result
from families.lfm2.cache import plans_per_shape
from families.lfm2.checkpoint import default_drafter_dir, default_target_dir

# Primitives that produce views of their input and launch no kernel.
VIEWS = {"Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "StopGradient", "AsStrided", "Split", "Depends"}


def op_names(outputs: list[mx.array]) -> collections.Counter:
    """How many primitives of each name the graph that builds `outputs` holds."""
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return collections.Counter(re.findall(r'label ="([^"]+)"', Path(f.name).read_text()))


def count_ops(names: collections.Counter) -> tuple[int, int]:
    """(primitives, primitives that are not views) of an `op_names` count."""
    return names.total(), sum(count for name, count in names.items() if name not in VIEWS)


class PlainSteps:
    def __init__(self, target, slots, first_tokens: mx.array, taps):
        self.target, self.slots, self.tokens, self.taps = target, slots, first_tokens, taps
        self.landing = None
        self.start = [slot.length for slot in slots]

    def build(self) -> list[mx.array]:
        out = self.target.forward(self.slots, self.tokens, taps=self.taps, key_bucket=256 if len(self.slots) > 1 else 1)
        self.tokens = mx.argmax(out.logits, axis=-1)
        self.target.commit(out, [1] * len(self.slots))
        if max(slot.length for slot in self.slots) + 1 >= self.target.context_limit:
            for slot, start in zip(self.slots, self.start):  # back to the prompt: steps go on at its context
                slot.length = start
        return [self.tokens, *([out.taps] if out.taps is not None else []), *self.target.state_arrays()]

    def pipelined(self) -> None:
        """As the engine runs plain rounds: launch the next step, then read this one's tokens."""
        landing = self.tokens
        mx.async_eval(self.build())
        if self.landing is not None:
            self.landing.tolist()
        self.landing = landing


class DraftRounds:
    def __init__(self, drafter, slots, anchors: list[int], taps_width: int, dtype):
        self.drafter, self.slots, self.anchors = drafter, slots, anchors
        self.row = mx.zeros((1, taps_width), dtype=dtype)
        # As the engine proposes: without confidences where rounds are priced ahead of the
        # proposal (steady shapes), if this copy of the package can leave them out.
        leaves_out = "confidences" in inspect.signature(drafter.propose).parameters
        self.unscored = {"confidences": False} if plans_per_shape() and leaves_out else {}

    def build(self) -> list[mx.array]:
        n = len(self.slots)
        self.drafter.append(self.slots, [self.row] * n, [[0]] * n)
        proposal = self.drafter.propose(self.slots, self.anchors, self.drafter.width, chain_logits=False, **self.unscored)
        for slot in self.slots:
            slot.length -= 1  # the context stays where it was: every round costs the same
        return [*proposal.arrays(), *self.drafter.state_arrays()]


class PromptReads:
    def __init__(self, target, slots, rows: int, taps, compiled: bool):
        self.target, self.slots, self.taps, self.compiled = target, slots, taps, compiled
        self.prompt = [1 + i % (target.vocab_size - 1) for i in range(rows)]

    def build(self) -> list[mx.array]:
        kept, self.target.compiled = self.target.compiled, self.compiled
        try:
            read = self.target.forward(self.slots, [self.prompt] * len(self.slots), logits="last", taps=self.taps, steady=True)
        finally:
            self.target.compiled = kept
        return [read.logits, *([read.taps] if read.taps is not None else []), *self.target.state_arrays()]


class PeerSteps:
    """mlx-lm's BatchGenerator decoding the same number of sequences."""

    def __init__(self, path: str, dtype: str | None, prompts: list[list[int]]):
        import mlx_lm
        from mlx.utils import tree_flatten
        from mlx_lm.generate import BatchGenerator

        model, _ = mlx_lm.load(path)
        if dtype:
            keep = getattr(model, "cast_predicate", lambda name: True)
            cast = [(k, v.astype(getattr(mx, dtype))) for k, v in tree_flatten(model.parameters()) if keep(k) and mx.issubdtype(v.dtype, mx.floating)]
            model.load_weights(cast, strict=False)
        self.generator = BatchGenerator(model, max_tokens=10**7, stop_tokens=None, completion_batch_size=len(prompts),
                                        prefill_batch_size=len(prompts), prefill_step_size=512)
        self.generator.insert(prompts)
        self.generator.next_generated()

    def step(self) -> None:
        self.generator.next_generated()


def timed_steps(step, seconds: float) -> tuple[list[float], list[float]]:
    """Wall and process-CPU seconds of each step (the CPU time of all the process's
    threads is the steadier figure on a shared CPU)."""
    wall, cpu, deadline = [], [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(wall) < 3:
        started, started_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return wall, cpu


def evaluated(build):
    return lambda: mx.eval(build())


BUILDS = 20  # builds timed per system for its `build ms`


def build_seconds(build) -> float:
    """The host's time to make one step's lazy graph (nothing evaluated yet), then its
    evaluation, untimed, so the next build starts from the state a step leaves."""
    began = time.perf_counter()
    outputs = build.build()
    seconds = time.perf_counter() - began
    mx.eval(outputs)
    return seconds


class System:
    """One copy of the families package (`pkg`: `families`, or an earlier copy importable
    under another name) with its target and drafter loaded."""

    def __init__(self, pkg: str, args):
        lfm2 = importlib.import_module(f"{pkg}.lfm2")
        drafter_module = importlib.import_module(f"{pkg}.lfm2.drafter")
        self.name = pkg
        # Room for a second set of lanes behind a hole (`--slot-gap`) or reading prompts (`--read`).
        max_lanes = max(args.lanes) * (1 + bool(args.slot_gap) + bool(args.read)) + bool(args.slot_gap)
        self.read_rows = args.read
        self.target = lfm2.open_target(args.model, dtype=args.dtype, max_lanes=max_lanes).target
        self.drafters = {}
        if args.drafter:
            def load():
                return drafter_module.load_drafter(args.drafter, self.target.model, self.target.config, dtype=args.dtype,
                                                   max_lanes=max_lanes)
            self.drafters["draft"] = load()
            if args.chain_ops and getattr(self.drafters["draft"], "fused_chain", None) is not None:
                self.drafters["draft-ops"] = load()
                self.drafters["draft-ops"].fused_chain = None  # before its first proposal is traced
        self.taps = self.drafters["draft"].tap_layers if self.drafters else ()
        self.opened = []  # (drafter name, or None for the target; its lanes)

    def open(self, prompts: list[list[int]], hole: bool = False) -> dict:
        """Lanes that have read `prompts`; their plain step and drafting round. With
        `hole`, a lane opened before them stays open and unread while they are timed, so
        their slots follow the lanes already open with a gap."""
        target = self.target
        holes = [target.open_lane()] if hole else []
        slots = [target.open_lane() for _ in prompts]
        self.opened.append((None, holes + slots))
        dslots = {}
        for name, drafter in self.drafters.items():
            holes = [drafter.open_lane()] if hole else []
            dslots[name] = [drafter.open_lane() for _ in prompts]
            self.opened.append((name, holes + dslots[name]))
        last = []
        for i, (slot, prompt) in enumerate(zip(slots, prompts)):
            logits, rows = target.prefill(slot, prompt, chunk=512, taps=self.taps)
            last.append(mx.argmax(logits))
            for name, drafter in self.drafters.items():
                drafter.append([dslots[name][i]], [rows], [prompt])
        # Read now, so that the prompts' graphs stay out of the first step's op count.
        mx.eval(last, target.state_arrays(), [d.state_arrays() for d in self.drafters.values()])
        builds = {"plain": PlainSteps(target, slots, mx.stack(last).astype(mx.int32), self.taps)}
        width = len(self.taps) * target.config.hidden_size
        for name, drafter in self.drafters.items():
            builds[name] = DraftRounds(drafter, dslots[name], [p[-1] for p in prompts], width, drafter.dtype)
        if self.read_rows and not hole:
            readers = [target.open_lane() for _ in prompts]
            self.opened.append((None, readers))
            for name, compiled in (("read", True), ("read-eager", False)):
                builds[name] = PromptReads(target, readers, self.read_rows, self.taps, compiled)
        return builds

    def close(self) -> None:
        for name, slots in self.opened:
            model = self.target if name is None else self.drafters[name]
            for slot in slots:
                model.close_lane(slot)
        self.opened = []


def run(args, saved=lambda result: None) -> dict:
    record = provenance()
    systems = [System(pkg, args) for pkg in args.families]
    vocab = systems[0].target.vocab_size
    rng = np.random.default_rng(0)
    result = {**record, "model": args.model, "drafter": args.drafter, "dtype": args.dtype, "context": args.context,
              "seconds": args.seconds, "turns": args.turns, "families": args.families, "lanes": {}}
    for lanes in args.lanes:
        prompts = [[int(t) for t in rng.integers(20, min(4000, vocab), args.context)] for _ in range(lanes)]
        steps, builds, cell = {}, {}, {}
        for system in systems:
            for hole in (False, True) if args.slot_gap else (False,):
                for kind, build in system.open(prompts, hole).items():
                    name = (f"{system.name}:{kind}" if len(systems) > 1 else kind) + ("@gap" if hole else "")
                    builds[name], cell[name] = build, {"turns": []}
                    steps[name] = build.pipelined if kind == "plain" else evaluated(build.build)
        if args.peer:
            peer = PeerSteps(args.model, args.dtype, prompts)
            steps["peer"], cell["peer"] = peer.step, {"turns": []}
        for step in steps.values():  # first-use costs (compilation, plans) stay out of the timing
            for _ in range(3):
                step()
        for name, build in builds.items():  # counted once warm: a first step also holds the pools' one-off growth
            outputs = build.build()
            names = op_names(outputs)
            cell[name]["ops"], cell[name]["op_names"] = count_ops(names), dict(names.most_common())
            mx.eval(outputs)
            cell[name]["build_ms"] = statistics.median(build_seconds(build) for _ in range(BUILDS)) * 1e3
        for turn in range(args.turns):
            order = list(steps) if turn % 2 == 0 else list(reversed(steps))
            for name in order:
                wall, cpu = timed_steps(steps[name], args.seconds)
                cell[name]["turns"].append({"median_ms": statistics.median(wall) * 1e3, "cpu_ms": statistics.median(cpu) * 1e3, "steps": len(wall)})
        for name, c in cell.items():
            medians = [t["median_ms"] for t in c["turns"]]
            c["median_ms"], c["spread_ms"] = statistics.median(medians), [min(medians), max(medians)]
            c["cpu_ms"] = statistics.median(t["cpu_ms"] for t in c["turns"])
        if args.peer:
            del peer
        for system in systems:
            system.close()
        result["lanes"][lanes] = cell
        saved(result)
        print(f"lanes {lanes}: " + "; ".join(
            f"{name} {c['median_ms']:.3f} ms [{c['spread_ms'][0]:.3f}, {c['spread_ms'][1]:.3f}] cpu {c['cpu_ms']:.3f}"
            + (f" build {c['build_ms']:.3f} ops {c['ops'][0]} kernels {c['ops'][1]}" if "ops" in c else "")
            for name, c in cell.items()), flush=True)
    if args.reserve:
        result["reserved"] = reserve_check(systems, args, rng)
        saved(result)
    return result


def reserve_check(systems: list[System], args, rng) -> dict:
    """A plain step of one lane and of the most lanes `--lanes` names, with the KV pools
    at their usual size and grown to hold `--reserve` positions per slot: equal when the
    KV writes update the pools in place, slower by a copy of every pool per step when they
    do not (on CUDA one lane's step and several lanes' attend by different paths)."""
    out = {}
    for lanes in sorted({1, max(args.lanes)}):
        prompts = [[int(t) for t in rng.integers(20, 4000, args.context)] for _ in range(lanes)]
        for system in systems:
            step = system.open(prompts)["plain"].pipelined
            for size in ("usual", "reserved"):
                if size == "reserved":
                    for pool in system.target.kv.values():
                        pool.reserve(args.reserve)
                    mx.eval(system.target.state_arrays())
                for _ in range(3):
                    step()
                wall, _ = timed_steps(step, args.seconds)
                out[f"{lanes}:{system.name}:{size}"] = {"median_ms": statistics.median(wall) * 1e3, "kv_bytes": system.target.kv_bytes()}
            system.close()
            usual, reserved = out[f"{lanes}:{system.name}:usual"], out[f"{lanes}:{system.name}:reserved"]
            print(f"KV pools of {reserved['kv_bytes'] / 1e9:.1f} GB: {system.name} plain step of {lanes} lane(s) "
                  f"{usual['median_ms']:.3f} -> {reserved['median_ms']:.3f} ms", flush=True)
    return out


def markdown(result: dict) -> str:
    lines = [markdown_line(result), "",
             (f"Context {result['context']}, dtype {result['dtype'] or 'as stored'}, {result['turns']} turns of "
             f"{result['seconds']} s per system; families packages: {', '.join(result['families'])}"), "",
             "| lanes | system | median ms | spread of turn medians | process CPU ms | build ms | ops | kernels |",
             "|---|---|---|---|---|---|---|---|"]
    for lanes, cell in result["lanes"].items():
        for name, c in cell.items():
            ops, built = c.get("ops", ("", "")), f"{c['build_ms']:.3f}" if "build_ms" in c else ""
            lines.append(f"| {lanes} | {name} | {c['median_ms']:.3f} | {c['spread_ms'][0]:.3f}-{c['spread_ms'][1]:.3f} | "
                         f"{c['cpu_ms']:.3f} | {built} | {ops[0]} | {ops[1]} |")
    if result.get("reserved"):
        lines += ["", "A plain step, KV pools at their usual size and grown (`--reserve`):", "",
                  "| lanes | system | pools | median ms | KV pool bytes |", "|---|---|---|---|---|"]
        lines += [f"| {' | '.join(name.split(':'))} | {c['median_ms']:.3f} | {c['kv_bytes']:,} |" for name, c in result["reserved"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_target_dir()))
    p.add_argument("--drafter", default=None, help="a DSpark drafter directory (default: the default drafter with the default model)")
    p.add_argument("--no-drafter", action="store_true", help="time plain steps only")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per system per turn")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--peer", action="store_true", help="also time mlx-lm's BatchGenerator (needs mlx-lm)")
    p.add_argument("--families", type=lambda s: s.split(","), default=["families"],
                   help="families packages to compare, by import name (default: families)")
    p.add_argument("--chain-ops", action="store_true",
                   help="also time the drafting round with its greedy chain as MLX operations (draft-ops), where it "
                        "otherwise runs as one kernel (CUDA)")
    p.add_argument("--slot-gap", action="store_true",
                   help="also time each lane count in slots after a gap (@gap): slot ids as an array, not views")
    p.add_argument("--read", type=int, default=0, metavar="ROWS", help="also time prompt reads of ROWS tokens, compiled and eager")
    p.add_argument("--reserve", type=int, default=0,
                   help="also time a plain step of one lane and of the most lanes with the KV pools grown to this many positions")
    p.add_argument("--out", help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="step")
    args = p.parse_args()
    if args.drafter is None and not args.no_drafter and args.model == str(default_target_dir()):
        args.drafter = str(default_drafter_dir())
    if args.no_drafter:
        args.drafter = None
    run(args, lambda result: save(result, args))


def save(result: dict, args) -> None:
    """Write what is measured so far (after every cell: a run cut short keeps its cells)."""
    if args.out:
        write_result(args.out, args.name, result, markdown(result))


if __name__ == "__main__":
    main()

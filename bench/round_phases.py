"""Where rounds' time goes, read from a lane-core log (`--log` of bench_engine or bench_default).

    python -m bench.round_phases LOG[.gz] --out DIR [--name NAME] [--min-rounds 20] [--between HH:MM:SS HH:MM:SS]
        [--tails LANES]

Groups the log's rounds by kind (plain, drafted, probe) and lane count and gives, per
group of at least `--min-rounds` rounds (all of them in the JSON): the rounds, their median seconds and tokens, milliseconds per emitted token over
all of them (their summed seconds over their summed tokens), and for drafted rounds the
median seconds of each phase the engine timed (`lanes.round.DRAFTED_PHASES`: draft
built and launched, priced, verify built and launched, the host sync, outcomes read,
commit; logs written before those were timed give the draft's seconds alone). A plain
round's seconds are those of a pipelined round: the next one is launched before it is
read. Writes NAME.json and NAME.md (default: the log's name with `-phases`).

A server's log (`laneserve serve --log-level DEBUG`) stamps each line with its time, and
a round is logged as it lands, so the interval since the round logged before it is the
wall time it took in service. Such a log also gives, per group, the rounds' median
interval and the share of those intervals their own seconds cover (intervals over a
second, where the engine idled, left out): what is left is the host's time outside
rounds, reading prompts above all (`RoundRunner._now`). `--between` keeps the rounds
logged within a window of the day (a cell of a benchmark). `--tails LANES` reads a
`bench_engine --log` (stamped since 4fe8f30): each drafting run at LANES streams, the wall
time and tokens while every lane decodes and in its tail, as lanes end one by one, and
those runs' drafted rounds by part (full or tail), rows per lane and first of a shape.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import TextIO

from bench.provenance import markdown_line, provenance, write_result
from lanes.round import DRAFTED_PHASES

PHASE_FIELDS = ("draft_seconds", *(f"{name}_seconds" for name in DRAFTED_PHASES if name != "draft"))
STAMP = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime, as `laneserve serve` writes it
IDLE_SECONDS = 1.0  # an interval longer than this held an idle engine, not a round


def open_log(path) -> TextIO:
    """A lane core's log as text, gzipped (`.gz`) or not."""
    return (gzip.open if str(path).endswith(".gz") else open)(path, "rt")


def stamp(line: str) -> datetime | None:
    try:
        return datetime.strptime(line[:23], STAMP)
    except ValueError:
        return None


def rounds(lines, between: tuple[str, str] | None = None) -> list[dict]:
    """The `round` lines of a lane-core log as dicts of their key=value fields, with
    `interval` (seconds since the round line before it) where lines are stamped; only
    those logged within `between` (times of day, "HH:MM:SS") when given."""
    found, previous = [], None
    for line in lines:
        if "round kind=" not in line:
            continue
        at = stamp(line)
        if between is not None and (at is None or not between[0] <= at.strftime("%H:%M:%S") < between[1]):
            continue
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        found.append({key: value if key == "kind" else float(value) for key, value in fields.items()})
        if at is not None and previous is not None:
            found[-1]["interval"] = (at - previous).total_seconds()
        previous = at
    return found


def drafting_runs(found: list[dict], lanes: int) -> list[list[dict]]:
    """The drafting runs of a `bench_engine --log` at `lanes` streams, each from its first
    round of `lanes` lanes that is not plain to the plain engine's next round of `lanes`
    lanes (its lanes end in one round, so it has no tail). The drafting engine's warm-up,
    whose rehearsal rounds are drafted rounds of every lane count, reads as a run of its
    own, the first."""
    runs, current = [], None
    for r in found:
        full = int(r["lanes"]) == lanes
        if current is None:
            if full and r["kind"] != "plain":
                current = [r]
        elif full and r["kind"] == "plain" and any(int(x["lanes"]) < lanes for x in current):
            runs.append(current)
            current = None
        else:
            current.append(r)
    return runs


def last_full(run: list[dict], lanes: int) -> int:
    """The index of a run's last round of every lane: its tail follows."""
    return max(i for i, r in enumerate(run) if int(r["lanes"]) == lanes)


def tails(found: list[dict], lanes: int) -> list[dict]:
    """Each drafting run's wall time and tokens while every lane decodes, and in its tail
    after, where lanes that drifted apart end one by one. Needs a stamped log."""
    out = []
    for run in drafting_runs(found, lanes):
        end = last_full(run, lanes)
        # A round's interval is its wall time (its own seconds for the first, or after an idle engine).
        wall = [r["interval"] if i and r.get("interval", IDLE_SECONDS + 1) <= IDLE_SECONDS else r["seconds"]
                for i, r in enumerate(run)]
        out.append({"full_seconds": sum(wall[: end + 1]), "full_tokens": sum(r["emitted"] for r in run[: end + 1]),
                    "tail_seconds": sum(wall[end + 1:]), "tail_tokens": sum(r["emitted"] for r in run[end + 1:]),
                    "tail_rounds": {kind: sum(1 for r in run[end + 1:] if r["kind"] == kind) for kind in ("drafted", "probe", "plain")}})
    return out


def drafted_by_width(found: list[dict], lanes: int) -> list[dict]:
    """The drafted rounds of every drafting run but the first (the warm-up's), grouped by
    where they ran (while every lane decodes, or in the tail), their rows per lane, and
    whether they were the first of their shape: the rounds and their median seconds. So
    a slow tail can be told from a wider verify or from shapes met for the first time."""
    groups = defaultdict(list)
    for run in drafting_runs(found, lanes)[1:]:
        end = last_full(run, lanes)
        for i, r in enumerate(run):
            if r["kind"] == "drafted":
                groups[("full" if i <= end else "tail", int(r["rows"] // r["lanes"]), bool(r.get("first_of_shape")))].append(r)
    return [{"part": part, "rows_per_lane": width, "first_of_shape": first, "rounds": len(group),
             "median_ms": 1e3 * statistics.median(r["seconds"] for r in group)}
            for (part, width, first), group in sorted(groups.items())]


def summary(found: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in found:
        groups[(r["kind"], int(r["lanes"]))].append(r)
    table = []
    for (kind, lanes), group in sorted(groups.items()):
        row = {"kind": kind, "lanes": lanes, "rounds": len(group),
               "median_ms": 1e3 * statistics.median(r["seconds"] for r in group),
               "median_emitted": statistics.median(r["emitted"] for r in group),
               "ms_per_token": 1e3 * sum(r["seconds"] for r in group) / max(sum(r["emitted"] for r in group), 1),
               "phases_ms": {}}
        timed = [r for r in group if r.get("interval", IDLE_SECONDS + 1) <= IDLE_SECONDS]
        if timed:
            row["median_interval_ms"] = 1e3 * statistics.median(r["interval"] for r in timed)
            row["in_rounds"] = sum(r["seconds"] for r in timed) / max(sum(r["interval"] for r in timed), 1e-9)
        if kind != "plain":
            for name in PHASE_FIELDS:
                if all(name in r for r in group):
                    row["phases_ms"][name.removesuffix("_seconds")] = 1e3 * statistics.median(r[name] for r in group)
        table.append(row)
    return table


def markdown(result: dict, min_rounds: int) -> str:
    groups = [r for r in result["groups"] if r["rounds"] >= min_rounds]
    names = [n for n in DRAFTED_PHASES if any(n in r["phases_ms"] for r in groups)]
    walls = any("in_rounds" in r for r in groups)
    window = f", logged from {result['between'][0]} to {result['between'][1]}" if result.get("between") else ""
    tail = ""
    if result.get("tails"):
        tail = "\n".join(["", f"Drafting runs of a bench_engine log at {result['tail_lanes']} streams: while every lane decodes, "
                           "then the tail, where lanes end one by one (wall seconds, tokens, the tail's rounds by kind; "
                           "the first holds the drafting engine's warm-up).", "",
                           "| run | full: s | tokens | tail: s | tokens | tail share of time [tokens] | tail rounds drafted / probe / plain |",
                           "|---:|---:|---:|---:|---:|---:|---|"]
                          + [f"| {i} | {t['full_seconds']:.3f} | {t['full_tokens']:g} | {t['tail_seconds']:.3f} | {t['tail_tokens']:g} | "
                             f"{t['tail_seconds'] / (t['full_seconds'] + t['tail_seconds']):.0%} "
                             f"[{t['tail_tokens'] / max(t['full_tokens'] + t['tail_tokens'], 1):.0%}] | "
                             f"{t['tail_rounds']['drafted']} / {t['tail_rounds']['probe']} / {t['tail_rounds']['plain']} |"
                             for i, t in enumerate(result["tails"], 1)]
                          + ["", "Their drafted rounds (runs 2 on) by where they ran, rows per lane and whether first of "
                             "their shape:", "", "| part | rows per lane | first of shape | rounds | median ms |",
                             "|---|---:|---|---:|---:|"]
                          + [f"| {w['part']} | {w['rows_per_lane']} | {'yes' if w['first_of_shape'] else 'no'} | {w['rounds']} "
                             f"| {w['median_ms']:.2f} |" for w in result["drafted_by_width"]]) + "\n"
    lines = [markdown_line(result), "",
             f"Rounds of `{result['log']}`{window}, groups of at least {min_rounds}; medians per round, ms per token over all of "
             "a group's rounds" + ("; interval: the wall time since the round logged before it, 'in rounds' the share of "
                                   "those intervals the rounds' own seconds cover" if walls else "") + ".", "",
             "| kind | lanes | rounds | median ms | median tokens | ms per token |" + (" median interval ms | in rounds |" if walls else "")
             + "".join(f" {n} ms |" for n in names),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if walls else "") + "---:|" * len(names)]
    for r in groups:
        phases = "".join(f" {r['phases_ms'][n]:.2f} |" if n in r["phases_ms"] else " |" for n in names)
        wall = (f" {r['median_interval_ms']:.2f} | {r['in_rounds']:.0%} |" if "in_rounds" in r else " | |") if walls else ""
        lines.append(f"| {r['kind']} | {r['lanes']} | {r['rounds']} | {r['median_ms']:.2f} | {r['median_emitted']:g} "
                     f"| {r['ms_per_token']:.3f} |{wall}{phases}")
    return "\n".join(lines) + "\n" + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name")
    parser.add_argument("--min-rounds", type=int, default=20, help="the fewest rounds a group in the markdown has")
    parser.add_argument("--between", nargs=2, metavar=("HH:MM:SS", "HH:MM:SS"),
                        help="only rounds logged from the first time of day to before the second (stamped logs)")
    parser.add_argument("--tails", type=int, metavar="LANES",
                        help="a bench_engine log: each drafting run at LANES streams, while every lane decodes and its tail")
    args = parser.parse_args()
    path = Path(args.log)
    with open_log(path) as f:
        found = rounds(f, tuple(args.between) if args.between else None)
    if not found:
        raise SystemExit(f"round_phases: {path} holds no round lines" + (f" logged from {args.between[0]} to {args.between[1]}"
                         if args.between else " (a lane-core log written with --log?)"))
    result = {**provenance(), "log": str(path), "between": args.between, "groups": summary(found)}
    if args.tails:
        result |= {"tail_lanes": args.tails, "tails": tails(found, args.tails),
                   "drafted_by_width": drafted_by_width(found, args.tails)}
    name = args.name or path.name.split(".")[0] + "-phases"
    write_result(args.out, name, result, markdown(result, args.min_rounds))
    print(markdown(result, args.min_rounds))


if __name__ == "__main__":
    main()

"""Where rounds' time goes, read from a lane-core log (`--log` of bench_engine or bench_default).

    python -m bench.round_phases LOG[.gz] --out DIR [--name NAME] [--min-rounds 20] [--between HH:MM:SS HH:MM:SS]

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
logged within a window of the day (a cell of a benchmark).
"""

from __future__ import annotations

import argparse
import gzip
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from bench.provenance import markdown_line, provenance, write_result
from lanes.round import DRAFTED_PHASES

PHASE_FIELDS = ("draft_seconds", *(f"{name}_seconds" for name in DRAFTED_PHASES if name != "draft"))
STAMP = "%Y-%m-%d %H:%M:%S,%f"  # logging's asctime, as `laneserve serve` writes it
IDLE_SECONDS = 1.0  # an interval longer than this held an idle engine, not a round


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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name")
    parser.add_argument("--min-rounds", type=int, default=20, help="the fewest rounds a group in the markdown has")
    parser.add_argument("--between", nargs=2, metavar=("HH:MM:SS", "HH:MM:SS"),
                        help="only rounds logged from the first time of day to before the second (stamped logs)")
    args = parser.parse_args()
    path = Path(args.log)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        found = rounds(f, tuple(args.between) if args.between else None)
    if not found:
        raise SystemExit(f"round_phases: {path} holds no round lines" + (f" logged from {args.between[0]} to {args.between[1]}"
                         if args.between else " (a lane-core log written with --log?)"))
    result = {**provenance(), "log": str(path), "between": args.between, "groups": summary(found)}
    name = args.name or path.name.split(".")[0] + "-phases"
    write_result(args.out, name, result, markdown(result, args.min_rounds))
    print(markdown(result, args.min_rounds))


if __name__ == "__main__":
    main()

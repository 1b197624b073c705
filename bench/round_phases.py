"""Where rounds' time goes, read from a lane-core log (`--log` of bench_engine or bench_default).

    python -m bench.round_phases LOG[.gz] --out DIR [--name NAME] [--min-rounds 20]

Groups the log's rounds by kind (plain, drafted, probe) and lane count and gives, per
group of at least `--min-rounds` rounds (all of them in the JSON): the rounds, their median seconds and tokens, milliseconds per emitted token over
all of them (their summed seconds over their summed tokens), and for drafted rounds the
median seconds of each phase the engine timed (`lanes.round.DRAFTED_PHASES`: draft
built and launched, priced, verify built and launched, the host sync, outcomes read,
commit; logs written before those were timed give the draft's seconds alone). A plain
round's seconds are those of a pipelined round: the next one is launched before it is
read. Writes NAME.json and NAME.md (default: the log's name with `-phases`).
"""

from __future__ import annotations

import argparse
import gzip
import statistics
from collections import defaultdict
from pathlib import Path

from bench.provenance import markdown_line, provenance, write_result
from lanes.round import DRAFTED_PHASES

PHASE_FIELDS = ("draft_seconds", *(f"{name}_seconds" for name in DRAFTED_PHASES if name != "draft"))


def rounds(lines) -> list[dict]:
    """The `round` lines of a lane-core log as dicts of their key=value fields."""
    found = []
    for line in lines:
        if "round kind=" not in line:
            continue
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        found.append({key: value if key == "kind" else float(value) for key, value in fields.items()})
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
        if kind != "plain":
            for name in PHASE_FIELDS:
                if all(name in r for r in group):
                    row["phases_ms"][name.removesuffix("_seconds")] = 1e3 * statistics.median(r[name] for r in group)
        table.append(row)
    return table


def markdown(result: dict, min_rounds: int) -> str:
    groups = [r for r in result["groups"] if r["rounds"] >= min_rounds]
    names = [n for n in DRAFTED_PHASES if any(n in r["phases_ms"] for r in groups)]
    lines = [markdown_line(result), "",
             f"Rounds of `{result['log']}`, groups of at least {min_rounds}; medians per round, ms per token over all of "
             "a group's rounds.", "",
             "| kind | lanes | rounds | median ms | median tokens | ms per token |" + "".join(f" {n} ms |" for n in names),
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(names)]
    for r in groups:
        phases = "".join(f" {r['phases_ms'][n]:.2f} |" if n in r["phases_ms"] else " |" for n in names)
        lines.append(f"| {r['kind']} | {r['lanes']} | {r['rounds']} | {r['median_ms']:.2f} | {r['median_emitted']:g} "
                     f"| {r['ms_per_token']:.3f} |{phases}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name")
    parser.add_argument("--min-rounds", type=int, default=20, help="the fewest rounds a group in the markdown has")
    args = parser.parse_args()
    path = Path(args.log)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        found = rounds(f)
    if not found:
        raise SystemExit(f"round_phases: {path} holds no round lines (a lane-core log written with --log?)")
    result = {**provenance(), "log": str(path), "groups": summary(found)}
    name = args.name or path.name.split(".")[0] + "-phases"
    write_result(args.out, name, result, markdown(result, args.min_rounds))
    print(markdown(result, args.min_rounds))


if __name__ == "__main__":
    main()

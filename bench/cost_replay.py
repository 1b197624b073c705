"""What the cost table makes of a round log: every round replayed into a fresh CostTable
as the round runner feeds it, with the table's estimates read just before each round of
one lane count.

    python -m bench.cost_replay LOG [--lanes 15] [--rows 60,150] [--after 'serving on'] [--out DIR] [--name cost-replay]

LOG is a lane core's debug log (`--log-level DEBUG`, gzipped or not), read from the first
line holding `--after` where one does (a server's warm-up rounds teach a throwaway
table, lanes/warmup.py), else whole. A round is evidence
unless its line says `first_of_shape=1` or `behind_prompt=1` (lanes/round.py `_account`):
its seconds less its draft seconds go in at its rows, lanes and context. The warm-up's
seeds are not in the log, so the table starts empty and a band borrows the nearest one
measured. Reported: the drafted rounds of `--lanes` lanes by the rows they verified, with the
median of the table's estimates at each of `--rows` just before them; then each band's
figure and rounds by row count at the end. Writes NAME.json and NAME.md under --out when
given, each with its command, commit and machine.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from bench.provenance import markdown_line, provenance, write_result
from bench.round_phases import open_log, rounds
from lanes.pricing import CostTable, NoCostData


def read_log(path: str, after: str) -> list[dict]:
    """The round lines of the log at `path` (round_phases.rounds) after the first line
    holding `after`, or all of them where none does (or `after` is empty)."""
    with open_log(path) as f:
        lines = f.readlines()
    start = next((i for i, text in enumerate(lines) if after and after in text), -1)
    return rounds(lines[start + 1:])


def replay(found: list[dict], lanes: int, rows: list[int]) -> dict:
    """`found` (round_phases.rounds) fed to a fresh table in order -> the estimates at
    `rows` before each round of `lanes` lanes, grouped by the rows that round verified,
    and the table's bands at the end."""
    table = CostTable()
    before = defaultdict(list)
    for r in found:
        if int(r["lanes"]) == lanes and r["kind"] == "drafted":
            try:
                curve = table.curve(lanes, int(r["context"]))
                before[int(r["rows"])].append([curve(n) for n in rows])
            except NoCostData:
                pass
        if r.get("first_of_shape") or r.get("behind_prompt"):
            continue
        seconds = r["seconds"] - r.get("draft_seconds", 0.0)
        if seconds > 0:
            table.observe(int(r["rows"]), int(r["lanes"]), int(r["context"]), seconds)
    return {
        "verified": {verified: {"rounds": len(estimates),
                                "estimates_ms": {n: statistics.median(e[i] for e in estimates) * 1e3 for i, n in enumerate(rows)}}
                     for verified, estimates in sorted(before.items())},
        "bands": [{"lanes": band.lanes, "context": band.context,
                   "by_rows": {n: {"ms": seconds * 1e3, "rounds": behind} for n, (seconds, behind) in by_rows.items()}}
                  for band, by_rows in table.figures().items()],
    }


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [markdown_line(result), "",
             f"Drafted rounds of {result['lanes']} lanes in `{result['log']}`, by the rows each verified, with the median of "
             f"the table's estimates just before them:", "",
             "| rows verified | rounds | " + " | ".join(f"estimate at {n} rows, ms" for n in rows) + " |",
             "|---:|---:|" + "---:|" * len(rows)]
    for verified, cell in result["verified"].items():
        lines.append(f"| {verified} | {cell['rounds']} | " + " | ".join(f"{cell['estimates_ms'][n]:.2f}" for n in rows) + " |")
    lines += ["", "The table at the end, by band: each row count's figure (ms) and the rounds it rests on.", ""]
    for band in result["bands"]:
        figures = ", ".join(f"{n}: {c['ms']:.2f} ({c['rounds']})" for n, c in band["by_rows"].items())
        lines.append(f"- lanes {band['lanes']}+, context up to {band['context']}: {figures}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", help="a lane-core debug log (.gz or plain)")
    p.add_argument("--lanes", type=int, default=15, help="the lane count whose rounds to read estimates before")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[60, 150],
                   help="row counts to estimate (comma-separated)")
    p.add_argument("--after", default="serving on", help="read rounds after the first line holding this ('' for all)")
    p.add_argument("--out", help="directory for NAME.json and NAME.md")
    p.add_argument("--name", default="cost-replay")
    args = p.parse_args()
    found = read_log(args.log, args.after)
    result = {**provenance(), "log": Path(args.log).name, "lanes": args.lanes, "rows": args.rows,
              **replay(found, args.lanes, args.rows)}
    text = markdown(result)
    if args.out:
        write_result(args.out, args.name, result, text)
    print(text, end="")


if __name__ == "__main__":
    main()

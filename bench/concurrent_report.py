"""bench_concurrent's report: figures over rounds, the markdown table and the plots.

    python -m bench.concurrent_report DIR   # DIR/bench_concurrent.json -> .md and .png again

Every figure is reported as its median over rounds with the min and max beside it; the
ratio to the baseline setting is taken per round (cells of one round ran next to each
other) and then its median, min and max over rounds.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from .provenance import markdown_line, median_range
from .serving_metrics import spread

SUMMARY_KEYS = (
    "output_throughput", "per_stream_output_throughput", "request_throughput", "total_output_tokens",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
    "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "prompt_lookup_share", "completed", "failed", "duration",
)


def summarize(cells: list[dict], baseline: str) -> list[dict]:
    """One entry per setting and stream count, by streams, settings in the order they first ran."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for cell in cells:
        groups.setdefault((cell["setting"], cell["streams"]), []).append(cell)
    base = {(c["round"], c["streams"]): c["output_throughput"] for c in cells if c["setting"] == baseline}
    summary = []
    for (setting, streams), runs in sorted(groups.items(), key=lambda kv: kv[0][1]):  # stable: settings in run order
        first = runs[0]
        entry = {"setting": setting, "server": first["server"], "draft": first["draft"], "streams": streams, "rounds": len(runs)}
        entry |= {key: spread([c.get(key) for c in runs]) for key in SUMMARY_KEYS}
        ratios = [c["output_throughput"] / base[(c["round"], streams)] for c in runs
                  if base.get((c["round"], streams)) and c["output_throughput"] is not None]
        entry["output_throughput_ratio"] = spread(ratios)
        positions = [c["spec_decode_per_position_acceptance_rates"] for c in runs if c.get("spec_decode_per_position_acceptance_rates")]
        entry["spec_decode_per_position_acceptance_rates"] = (
            [statistics.median(rates) for rates in zip(*positions)] if positions else None
        )
        entry["failures"] = dict(sum((Counter(c["failures"]) for c in runs), Counter()))
        kinds = [c["rounds_by_kind"] for c in runs if c.get("rounds_by_kind")]
        entry["rounds_by_kind"] = dict(sum((Counter(k) for k in kinds), Counter())) if kinds else None
        summary.append(entry)
    return summary


def _fmt(s: dict, digits: int = 1, suffix: str = "") -> str:
    if s["median"] is None:
        return "-"
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}{suffix}"
    return median_range(s, digits, suffix)


def markdown(result: dict) -> str:
    lines = [
        "# bench_concurrent",
        "",
        markdown_line(result),
        (f"- {result['prompt_count']} prompts ({result['prompts']}, {'distinct per request' if result['distinct'] else 'all the same'}), "
        f"{result['endpoint']} endpoint, max_tokens {result['max_tokens']}"
        + (f" x (1 -/+ {result['max_tokens_spread']:g}), drawn per request" if result.get("max_tokens_spread") else "")
        + f", temperature {result['temperature']}"),
        (f"- cells of at least {result['min_seconds']} s with the streams full, {result['rounds_run']} round(s) of "
        f"{result['rounds']} asked; each figure is the "
        "median over rounds [min-max]; 'vs base' is the per-round ratio of output tok/s to "
        f"`{result['baseline']}` at the same streams"),
        "- servers: " + "; ".join(f"{s['label']} {s['url']} (/metrics {'yes' if s['metrics'] else 'no'}, "
                                  f"drafting {'counted' if s['drafting'] else 'not counted'}, tokens per chunk from {s['token_counting']})"
                                  for s in result["servers"]),
        "",
        ("| setting | streams | output tok/s | vs base | per stream tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| TPOT mean ms | accepted % | accept length | failed |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for e in result["summary"]:
        lines.append(
            f"| {e['setting']} | {e['streams']} | {_fmt(e['output_throughput'])} | {_fmt(e['output_throughput_ratio'], 2, 'x')} "
            f"| {_fmt(e['per_stream_output_throughput'])} | {_fmt(e['median_ttft_ms'], 0)} / {_fmt(e['p99_ttft_ms'], 0)} "
            f"| {_fmt(e['median_itl_ms'], 2)} / {_fmt(e['p99_itl_ms'], 2)} | {_fmt(e['mean_tpot_ms'], 2)} "
            f"| {_fmt(e['spec_decode_acceptance_rate'])} | {_fmt(e['spec_decode_acceptance_length'], 2)} "
            f"| {sum(e['failures'].values()) or 0} |"
        )
    drafted = [e for e in result["summary"] if e["spec_decode_per_position_acceptance_rates"]]
    if drafted:
        lines += ["", ("Acceptance per draft position (share of drafts whose k-th draft was accepted; median over rounds), "
                  "the share of drafts copied by prompt lookup (median over rounds; '-': not counted), "
                  "and rounds by kind over all rounds:"), "",
                  "| setting | streams | per position | looked up | rounds by kind |", "| --- | ---: | --- | ---: | --- |"]
        for e in drafted:
            rates = ", ".join(f"{r:.2f}" for r in e["spec_decode_per_position_acceptance_rates"])
            kinds = ", ".join(f"{k} {int(v)}" for k, v in sorted((e["rounds_by_kind"] or {}).items()))
            lines.append(f"| {e['setting']} | {e['streams']} | {rates} | {_fmt(e['prompt_lookup_share'], 2)} | {kinds or '-'} |")
    failures = [e for e in result["summary"] if e["failures"]]
    if failures:
        lines += ["", "Failures by status: " + "; ".join(f"{e['setting']} x{e['streams']}: {e['failures']}" for e in failures)]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Output tok/s and ITL p50 / p99 against streams, one line per setting, min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, itl) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, setting in enumerate(result["settings"]):
        entries = sorted((e for e in result["summary"] if e["setting"] == setting), key=lambda e: e["streams"])
        entries = [e for e in entries if e["output_throughput"]["median"] is not None]
        if not entries:
            continue
        color = f"C{i}"
        dodge = 2 ** (0.03 * (i - (len(result["settings"]) - 1) / 2))  # settings side by side, so bars do not hide each other
        streams = [e["streams"] * dodge for e in entries]

        def bars(key, entries=entries):
            s = [e[key] for e in entries]
            return [x["median"] for x in s], [[x["median"] - x["min"] for x in s], [x["max"] - x["median"] for x in s]]

        y, err = bars("output_throughput")
        throughput.errorbar(streams, y, yerr=err, color=color, marker="o", capsize=3, label=setting)
        for key, style, name in (("median_itl_ms", "-", "p50"), ("p99_itl_ms", "--", "p99")):
            if any(e[key]["median"] is None for e in entries):
                continue
            y, err = bars(key)
            itl.errorbar(streams, y, yerr=err, color=color, linestyle=style, marker="o" if name == "p50" else "s",
                         capsize=3, label=f"{setting} {name}")
    for ax in (throughput, itl):
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["streams"], [str(n) for n in result["streams"]])
        ax.set_xlabel("streams in flight")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    throughput.set_ylabel("output tok/s (all streams)")
    throughput.set_title("Output throughput (median, min-max over rounds)")
    itl.set_ylabel("inter-token latency, ms")
    itl.set_title("ITL p50 (solid) and p99 (dashed)")
    fig.suptitle(result["command"][:140], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, result: dict) -> None:
    """The table and, where matplotlib is installed, the plots (else re-run this module
    on the JSON where it is)."""
    (out / "bench_concurrent.md").write_text(markdown(result))
    try:
        plot(result, out / "bench_concurrent.png")
    except ImportError:
        print("no matplotlib here: no plot; `python -m bench.concurrent_report DIR` makes it from the JSON",
              file=sys.stderr)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    data = json.loads((folder / "bench_concurrent.json").read_text())
    data["summary"] = summarize(data["cells"], data["baseline"])
    write_report(folder, data)

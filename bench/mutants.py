"""Mutation check: plant known bugs in a scratch copy of the repository, one at a time,
and report which of them the test suite catches. Every one must be caught.

    python -m bench.mutants [--list] [--check] [--only NAME ...] [--out FILE.md] [--timeout 1800]
        [--source worktree|HEAD] [--logs DIR] [--skip-control]

Each mutant is a few exact edits (a file, a source snippet, its replacement). A snippet
must occur exactly once in its file, else the check stops with exit status 2 naming the
mutant: code that moved must not leave a mutant silently testing nothing. The mutated
file must still compile, so a mutant is caught by behaviour, never by a syntax error.

The repository is snapshotted once into a temporary directory (a clone sharing this
checkout's objects, at the commit HEAD names when the check starts, with the working
tree's tracked files over it, or with `--source HEAD` as committed), so commits landing
meanwhile change nothing. For each mutant a fresh copy of the snapshot gets the edits and
`python -m pytest -x -q -p no:cacheprovider` runs there with this interpreter: the test
files likeliest to catch the mutant first, then every other test file. The package is
installed editable from the main checkout, so the run starts in the copy with the copy
on PYTHONPATH, and a plugin written into the copy checks at pytest's start that
`lanes`, `families`, `daemon` and `bench` are imported from the copy (exit status 2 if
not). A catch counts once the failing test fails again alone on the mutant and passes
alone on the unmutated copy; a failure that does not is deselected and the suite runs
on. The unmutated copy runs the whole suite first, as a control, and must pass (a test
that fails there and passes alone on a rerun is reported as flaky).

The acceptance rule of `lanes/verify.py` is token equality with a seeded Gumbel-max draw
per row (`lanes/sampling.py`): there is no residual max(p - q, 0) to resample from. The
"residual from p" mutant is its analogue: after a rejection, the emitted token is a
fresh draw from the target's p with independent noise (another key) instead of the
row's coupled choice. As resampling from p instead of the residual does, it tilts the
output law toward the drafter's proposals (the fresh draw may repeat the rejected
draft), and drafted output no longer equals plain output token for token.

Exit status: 0 when every mutant is caught, 1 when one survives (or its run timed out),
2 when the check cannot run (a snippet not found exactly once, imports from the wrong
tree), 3 when the unmutated control fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lanes", "families", "daemon", "bench")
GUARD_PLUGIN = "_mutants_import_guard"
GUARD_SENTINEL = "MUTANTS-IMPORT-GUARD"
SELF_TEST = "test_mutants.py"


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    plants: str  # the bug, in words
    edits: tuple[Edit, ...]
    catchers: tuple[str, ...]  # test files to run first (an order hint; every file runs)

    @property
    def files(self) -> str:
        return ", ".join(dict.fromkeys(edit.path for edit in self.edits))


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "acceptance-off-by-one",
        "a draft is counted as accepted before it is compared, so the first mismatching draft is kept too",
        (Edit("lanes/acceptance.py",
              "        if draft != choice:\n            break\n        accepted += 1\n",
              "        accepted += 1\n        if draft != choice:\n            break\n"),),
        ("tests/test_sampling.py", "tests/test_drafting_exact.py"),
    ),
    Mutant(
        "residual-from-p",
        "after a rejection the emitted token is a fresh draw from the target's p with independent noise "
        "(another key), not the row's coupled choice (the analogue of resampling from p instead of the residual)",
        (Edit("lanes/verify.py",
              "    return RowChoices(row_starts, windows, choices, logprob_arrays(logits, choices, wanted), wanted)\n",
              "    result = RowChoices(row_starts, windows, choices, logprob_arrays(logits, choices, wanted), wanted)\n"
              "    result.fresh = choose(target, params, [(k * 0x9E3779B1 + 1) & 0xFFFFFFFF for k in keys])\n"
              "    return result\n"),
         Edit("lanes/verify.py",
              "            outcomes.append(Outcome(accepted, mine[: accepted + 1], logprobs))\n",
              "            fresh = self.fresh.tolist()\n"
              "            last = fresh[start + accepted] if accepted < len(w.drafts) else mine[accepted]\n"
              "            outcomes.append(Outcome(accepted, mine[:accepted] + [last], logprobs))\n")),
        ("tests/test_drafting_exact.py",),
    ),
    Mutant(
        "conv-state-not-rolled-back",
        "commit keeps the last L-1 rows of each conv window whatever was kept, as if every verify row were accepted",
        (Edit("families/lfm2/target.py",
              "state = window[:, -span:] if pick is None else mx.take_along_axis(window, pick, axis=1)",
              "state = window[:, -span:]"),),
        ("tests/test_lfm2_rounds.py", "tests/test_drafting_exact.py"),
    ),
    Mutant(
        "kv-length-not-trimmed",
        "commit advances a lane's committed length by the rows it fed, not the rows it kept (rejected KV rows stay)",
        (Edit("families/lfm2/target.py",
              "        for lane, k in zip(record.lanes, kept_sorted):\n            lane.length += k\n",
              "        for lane, w in zip(record.lanes, record.layout.widths):\n            lane.length += w\n"),),
        ("tests/test_lfm2_rounds.py", "tests/test_drafting_exact.py"),
    ),
    Mutant(
        "stop-string-leaks-ids",
        "a lane goes on appending the round's tokens after the one that completes a stop string "
        "(the text is still cut; the ids leak)",
        (Edit("lanes/lane.py",
              "                if hit:\n                    self.finish_reason = FinishReason.STOP\n"
              "                    kept = kept[:count]\n                    break\n",
              "                if hit:\n                    self.finish_reason = FinishReason.STOP\n"),),
        ("tests/test_client.py", "tests/test_drafting_exact.py", "tests/test_engine.py", "tests/test_daemon.py"),
    ),
    Mutant(
        "cancelled-neighbour-shifted",
        "landing a plain round whose lanes include one that left (cancelled, or ended the round before), "
        "the remaining lanes are paired with the rows from the wrong index: each neighbour after it takes its "
        "predecessor's token, taps and anchor",
        (Edit("lanes/round.py",
              "        for i, (lane, token, logprob) in enumerate(zip(dispatch.lanes, tokens, logprobs)):\n",
              "        live = [lane for lane in dispatch.lanes if not lane.finished]\n"
              "        for i, (lane, token, logprob) in enumerate(zip(live, tokens, logprobs)):\n"),),
        ("tests/test_cancel_neighbours.py", "tests/test_engine.py", "tests/test_client.py", "tests/test_daemon.py"),
    ),
    Mutant(
        "drafter-context-skips-accepted",
        "after a drafted round only the anchor's row is queued for the drafter's context, not the accepted "
        "drafts' rows (its context falls behind the target's; output stays exact, drafting quietly decays)",
        (Edit("lanes/round.py",
              "                lane.pending_taps.append((out.taps, start, start + 1 + outcome.accepted))\n"
              "                lane.pending_tokens += [lane.anchor] + window.drafts[: outcome.accepted]\n",
              "                lane.pending_taps.append((out.taps, start, start + 1))\n"
              "                lane.pending_tokens += [lane.anchor]\n"),),
        ("tests/test_drafting_exact.py", "tests/test_engine.py", "tests/test_drafter.py"),
    ),
    Mutant(
        "penalty-ignored-on-verify-rows",
        "verify chooses from the raw logits: a lane's repetition penalty is ignored on drafted rounds' rows",
        (Edit("lanes/verify.py",
              "    target = logits if seen is None else penalize(logits, seen, [p.repetition_penalty for p in params])\n",
              "    target = logits\n"),),
        ("tests/test_drafting_exact.py",),
    ),
    Mutant(
        "pipelined-penalty-misses-inflight-token",
        "a pipelined plain round does not count the token the round before chose (still on the device) as seen "
        "by the repetition penalty",
        (Edit("lanes/round.py",
              "tokens = self._choose(out.logits, lanes, ahead=ahead, previous=anchors if lazy else None)",
              "tokens = self._choose(out.logits, lanes, ahead=ahead, previous=None)"),),
        ("tests/test_drafting_exact.py", "tests/test_engine.py"),
    ),
    Mutant(
        "prefix-conv-state-not-restored",
        "a lane resumed from the prefix cache gets the cached K/V rows but starts its conv layers from zeros",
        (Edit("families/lfm2/target.py",
              "            self.conv[i].state[lane.slot] = conv[j].astype(self.dtype)\n",
              "            self.conv[i].state[lane.slot] = mx.zeros_like(conv[j]).astype(self.dtype)\n"),),
        ("tests/test_prefix_cache.py", "tests/test_daemon_prefix_cache.py"),
    ),
    Mutant(
        "prefix-boundary-state-at-round-end",
        "a block boundary crossed inside a round records the conv state at the round's end, not at the boundary",
        (Edit("families/lfm2/target.py", "                rows = boundary - lane.length\n", "                rows = k\n"),),
        ("tests/test_prefix_cache.py",),
    ),
    Mutant(
        "lookup-copies-one-period",
        "prompt lookup's copy stops at the end of the tokens: in a loop of period p it proposes p tokens, not the width",
        (Edit("lanes/lookup.py", "                while len(copied) < width:", "                while False:"),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "lookup-chances-shared-by-sampling",
        "greedy and sampled lanes price lookup windows from one set of chances (sampled lanes' failures lower greedy ones')",
        (Edit("lanes/round.py", "        key = (greedy, context_band(context_tokens))", "        key = (True, context_band(context_tokens))"),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "counted-chances-one-context-band",
        "drafts' survival is counted over every context at once: a long lane's windows are priced by what its short "
        "ones kept",
        (Edit("lanes/round.py", "        key = (greedy, context_band(context_tokens))", "        key = (greedy, context_band(0))"),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "drafter-record-one-context-band",
        "the drafter's calibration and yield are learnt over every context at once: a long lane's confidences are "
        "calibrated, and its lookups weighed, by what its short ones taught",
        (Edit("lanes/round.py", "        band = context_band(context_tokens)\n", "        band = context_band(0)\n"),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "drafter-yield-learnt-at-one-band",
        "every window's kept drafts go to one band's yield, whatever the lane's context",
        (Edit("lanes/round.py", "            self.drafter_record(lane.context).yields.append(accepted)",
              "            self.drafter_record(0).yields.append(accepted)"),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "calibration-learnt-at-one-band",
        "every window's verify outcome calibrates one band's confidences, whatever the lane's context",
        (Edit("lanes/round.py", "                self.drafter_record(lane.context).calibrator.observe(",
              "                self.drafter_record(0).calibrator.observe("),),
        ("tests/test_lookup.py",),
    ),
    Mutant(
        "priced-out-round-drafted",
        "a round whose every window prices at no draft still runs the drafter and a one-row verify per lane",
        (Edit("lanes/round.py", "            if not decision.draft or self._priced_out(lanes, eligible):",
              "            if not decision.draft:"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "drafted-round-prices-twice",
        "a drafted round prices its windows again after the check that some window takes a draft priced them",
        (Edit("lanes/round.py", "        priced, self._priced = self._priced, None\n        return priced[2] if",
              "        priced, self._priced = None, None\n        return priced[2] if"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "priced-depths-outlive-a-landing",
        "depths priced before a round in flight lands are reused after it: a window may take a draft more than its "
        "lane has room for",
        (Edit("lanes/round.py", "        self._inflight, self._priced = None, None  # the lanes moved on",
              "        self._inflight = None  # the lanes moved on"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "prompt-read-counted-as-round-time",
        "rounds are timed on the clock itself, the host's time reading a prompt's chunk inside their interval "
        "included: plain rounds look as slow as the prompts read beside them",
        (Edit("lanes/round.py", "        return self.clock() - self._prompt_seconds\n", "        return self.clock()\n"),),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "unseen-slice-taken-as-evidence",
        "the round launched after a prompt's chunk that no read waits for is timed as evidence, the chunk's "
        "device time perhaps in it",
        (Edit("lanes/round.py", "self._prompt_in_flight, self._behind_prompt = read, not read.lanes", "self._prompt_in_flight, self._behind_prompt = read, False"),),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "guard-probes-uncapped",
        "the guard's probes are limited by its loss budget only, not by their share of recent rounds: "
        "a loser that looks nearly free runs round after round",
        (Edit("lanes/guard.py", "        if evidence.probe_share >= self.max_probe_share:", "        if False:"),),
        ("tests/test_guard.py",),
    ),
    Mutant(
        "guard-plain-never-probed",
        "plain, when drafting wins, is never probed, however old its evidence: "
        "a plain estimate that luck put low is never measured again",
        (Edit("lanes/guard.py", "            return loser.weight < STALE_WEIGHT\n", "            return False\n"),),
        ("tests/test_guard.py",),
    ),
    Mutant(
        "guard-plain-probes-from-budget",
        "plain, when drafting wins, is probed as the budget allows (as drafting is), not only when its evidence is stale: "
        "plain probes spend the budget drafting needs",
        (Edit("lanes/guard.py", "        if not drafting:\n            return loser.weight < STALE_WEIGHT\n", ""),),
        ("tests/test_guard.py",),
    ),
    Mutant(
        "guard-stale-drafting-probed",
        "drafting, when it loses, is also probed whenever its evidence is stale, whatever the budget says: "
        "where it loses by far (long contexts) those probes alone lose several percent",
        (Edit("lanes/guard.py", "        if not drafting:\n", "        if not drafting or loser.weight < STALE_WEIGHT:\n"),),
        ("tests/test_guard.py",),
    ),
    Mutant(
        "carried-lanes-take-the-first-rows",
        "an overlapped drafted round after lanes ended takes the first rows of the round in flight as the remaining "
        "lanes' anchors, not each lane's own row",
        (Edit("lanes/round.py", "        return (DeviceLengths(lengths[index], tuple(bounds[i] for i in order)), anchors[index],\n",
              "        return (DeviceLengths(lengths[index], tuple(bounds[i] for i in order)), anchors[: len(lanes)],\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "joined-lane-keyed-one-ahead",
        "a lane that joins a pipelined plain round draws its noise one position ahead, as if its anchor were a choice "
        "the host had not read",
        (Edit("lanes/round.py", "[int(i < len(previous.lanes)) for i in order], order\n", "[1 for i in order], order\n"),),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "guard-far-loser-charged-its-loss",
        "a drafted probe is charged what it lost however far drafting lags: at long contexts, where a probe keeps "
        "a quarter of plain's throughput, probes spend the whole budget",
        (Edit("lanes/guard.py", "    return lost * max(1.0, FAR_LOSER * plain_tps / drafted_tps) if drafted else lost\n",
              "    return lost\n"),),
        ("tests/test_guard.py",),
    ),
    Mutant(
        "guard-fed-tokens-uncounted",
        "the guard is fed a round's tokens as emitted, not counted at its band's smallest lane count: a band's "
        "rounds of few lanes then read slower than its rounds of many, whatever each choice does",
        (Edit("lanes/round.py", "        return report.emitted * token_seconds(report.lanes) / token_seconds(floor)\n",
              "        return report.emitted\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "plain-round-priced-as-narrowest-verify",
        "a plain round is priced from its own band's curve even where the band has run only wider verifies, so "
        "on the CPU the guard counts a band's tokens by a verify's cost until plain rounds of each lane count run there",
        (Edit("lanes/pricing.py", "        fitting = {band: by_rows for band, by_rows in self._round_seconds.items() if min(by_rows) <= lanes}\n",
              "        fitting = {}\n"),),
        ("tests/test_pricing.py",),
    ),
    Mutant(
        "steady-prompt-reads-eager",
        "a steady prompt read wider than a verify window runs eagerly: a joining lane's chat prompt issues about "
        "half again as many kernels, each launched while the decoding lanes wait",
        (Edit("families/lfm2/target.py", "(widths[0] <= SMALL_QUERY or padded)", "widths[0] <= SMALL_QUERY"),),
        ("tests/test_lfm2_compiled.py",),
    ),
    Mutant(
        "warm-up-reads-prompts-on-the-first-slots-only",
        "the warm-up reads each steady prompt shape on slots 0..N-1 only: a lane joining on an ended lane's slot "
        "meets a trace of its own (slot ids) in service, its first read paying for it",
        (Edit("lanes/warmup.py", "for first in [0, 1] if lanes < max_lanes else [0]:", "for first in [0]:"),),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "cost-fit-by-running-maximum",
        "the cost curve is made non-decreasing by a running maximum: one row count measured once and high (a join "
        "in its interval) prices every wider window as dearly until it is measured again, which pricing then avoids",
        (Edit("lanes/pricing.py", "    seconds = monotone_fit([seconds_by_rows[r] for r in measured], weights)\n",
              "    seconds = [max(seconds_by_rows[r] for r in measured[: i + 1]) for i in range(len(measured))]\n"),),
        ("tests/test_pricing.py",),
    ),
    Mutant(
        "cost-fit-unweighted",
        "the cost curve's monotone fit weighs a row count measured once as much as one measured in every round",
        (Edit("lanes/pricing.py", "    weights = [1.0 if rounds_by_rows is None else rounds_by_rows.get(r, 1.0) for r in measured]\n",
              "    weights = [1.0 for r in measured]\n"),),
        ("tests/test_pricing.py",),
    ),
    Mutant(
        "first-round-of-a-shape-timed",
        "a round of a shape the backend meets for the first time (tracing, on CUDA planning, for it) is fed to the "
        "guard and the cost table: in a batch's tail each new lane count's first rounds decide its band",
        (Edit("lanes/round.py", "        if shape in self._shapes_run:\n", "        if True:\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "turns-timed-on-the-wall-clock",
        "bench_engine's turns time each engine's rounds on the wall clock: a round in flight as a turn ends counts "
        "the other engine's whole turn, and the guard sees plain rounds far slower than they are",
        (Edit("bench/bench_engine.py", "    clock.resume()\n    try:\n        yield\n    finally:\n        clock.pause()\n",
              "    yield\n"),),
        ("tests/test_bench_engine.py",),
    ),
    Mutant(
        "priced-by-real-rows-though-padded",
        "where rounds pad every lane to a bucketed window, windows are still priced by their real rows: "
        "a bucket is paid for and left part empty",
        (Edit("lanes/round.py", "                padded_width=self.verify_width if self.steady_shapes else None,\n", ""),),
        ("tests/test_pricing.py",),
    ),
    Mutant(
        "steady-prompt-read-logits-from-padding",
        "a prompt chunk padded to a steady width gives its first token from the last padding row, "
        "not from the lane's own last row",
        (Edit("families/lfm2/target.py", "for s, w in zip(row_starts, own)]", "for s, w in zip(row_starts, widths)]"),),
        ("tests/test_lfm2_rounds.py",),
    ),
    Mutant(
        "steady-prompt-read-past-the-limit",
        "a prompt chunk near the context limit is still padded to a steady width, its padding rows past the limit",
        (Edit("families/lfm2/target.py", " or max(bounds) + width > self.context_limit:", ":"),),
        ("tests/test_lfm2_rounds.py",),
    ),
    Mutant(
        "padded-prompt-chunk-takes-the-fused-kernel",
        "where the backend plans per shape, a prompt's partial chunk padded to a multiple of STEADY_QUERY rows "
        "takes the fused attention by its padded rows: a new cuDNN plan for each new key span",
        (Edit("families/lfm2/model.py", "layout.attention_mask(layout.span), rows=layout.own_width)",
              "layout.attention_mask(layout.span))"),),
        ("tests/test_attention_paths.py",),
    ),
    Mutant(
        "conv-kernel-commit-misorders-lanes",
        "on CUDA, a verify's conv states are rebuilt with each lane's kept rows taken from another lane "
        "(the kernels' path; the CPU's operations are untouched)",
        (Edit("families/lfm2/target.py", "record.lanes]), kept_array)", "record.lanes]), kept_array[::-1])"),),
        ("tests/test_conv_kernel.py",),
    ),
    Mutant(
        "attention-kernel-verify-sees-ahead",
        "on CUDA, a verify window's rows each attend over the whole window, later drafts included "
        "(the attention kernel's path; the CPU's operations are untouched)",
        (Edit("families/lfm2/model.py", "self.scale,\n                                                   causal=True)",
              "self.scale,\n                                                   causal=False)"),),
        ("tests/test_attention_kernel.py",),
    ),
    Mutant(
        "attention-kernel-block-seen-causally",
        "on CUDA, a drafter's block rows no longer see the block rows after them (the attention kernel's path)",
        (Edit("families/lfm2/drafter/model.py", "self.scale,\n                                                   causal=False)",
              "self.scale,\n                                                   causal=True)"),),
        ("tests/test_attention_kernel.py",),
    ),
    Mutant(
        "overlap-conv-state-of-whole-window",
        "an overlapped drafted round keeps each conv state as if every verify row were accepted (the device's "
        "count of kept rows is not used)",
        (Edit("lanes/round.py", "        self.target.keep(out, accepted + 1)\n",
              "        self.target.keep(out, mx.full((n,), width, dtype=mx.int32))\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "overlap-anchor-from-first-row",
        "the round after an overlapped one is fed, as each lane's anchor, the target's choice on its first verify "
        "row, not the one after its kept drafts",
        (Edit("lanes/round.py", "        following = mx.take_along_axis(grid, accepted[:, None], axis=1)[:, 0]\n",
              "        following = grid[:, 0]\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "overlap-ended-lane-landed",
        "landing an overlapped round, a lane that ended in the round before (cancelled, or at a stop) is emitted "
        "and counted again",
        (Edit("lanes/round.py",
              "            if lane.finished:  # it ended in the round before: these rows were wasted\n"
              "                counts.append(0)\n"
              "                continue\n", ""),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "overlap-seen-misses-kept-tokens",
        "the round after an overlapped one penalises what its lanes had seen before it, not the tokens that "
        "round kept",
        (Edit("lanes/round.py", "            seen = seen.at[mx.repeat(mx.arange(n), width), grid.reshape(-1)].maximum(kept)\n",
              "            seen = seen\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "overlap-noise-one-position-late",
        "an overlapped round keys each row's sampling noise by the position after the one it decides",
        (Edit("lanes/round.py", "lengths.lengths[:, None] + 1 + mx.arange(g + 1))", "lengths.lengths[:, None] + 2 + mx.arange(g + 1))"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "overlap-bounds-grow-by-width",
        "the host's bound on an overlapped lane's length grows by every round's width, never tightened to what "
        "the round before kept (the next rounds overstate it and reach the context limit early)",
        (Edit("lanes/round.py",
              "            following.lengths = DeviceLengths(following.lengths.lengths,\n"
              "                                              tuple(lane.target_slot.length + following.width for lane in lanes))\n",
              ""),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "buffer-cache-freed-as-each-lane-ends",
        "the engine hands MLX's buffer cache back whenever a lane ends, not only when it goes idle or the cache "
        "outgrows its bound (on CUDA each such free waits for the device, and the rounds after allocate afresh)",
        (Edit("lanes/engine.py", "        if not self._running or mx.get_cache_memory() > max(CACHE_HELD_FLOOR, reserved):\n",
              "        if True:\n"),),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "kv-pools-shrink-to-rows-alone",
        "as a lane ends the KV pools shrink to the rows the longest lane left holds, without the step its next rounds "
        "ask for beyond them: the next round grows them back, and lanes ending one by one copy every pool twice each",
        (Edit("families/lfm2/cache.py", "            pool.shrink(longest + KVPool.STEP if longest else 0)\n",
              "            pool.shrink(longest)\n"),),
        ("tests/test_overlap.py",),
    ),
    Mutant(
        "warm-up-keeps-prompt-shape-buffers",
        "the warm-up's prompt-shape profile leaves every shape's buffers in MLX's cache, and an engine that has "
        "warmed up holds them until its first request's lanes end",
        (Edit("lanes/warmup.py", "                mx.clear_cache()\n                previous = lanes\n",
              "                previous = lanes\n"),
         Edit("lanes/engine.py", "        # The profile read prompts at every steady shape; an idle engine holds none of it.\n"
              "        mx.clear_cache()\n", "")),
        ("tests/test_engine.py",),
    ),
    Mutant(
        "cuda-graphs-on-by-default",
        "MLX records kernels into CUDA graphs unless told otherwise, as MLX itself defaults",
        (Edit("families/backend.py", '    "MLX_USE_CUDA_GRAPHS": "0",\n', ""),),
        ("tests/test_backend.py",),
    ),
    Mutant(
        "out-of-memory-reported-as-a-bug",
        "an allocator's out-of-memory error reads as a bug in laneserve (status 70), as any other RuntimeError",
        (Edit("daemon/cli.py", "    if isinstance(error, MemoryError):\n        return True\n"
              "    return error is not None and any(words in str(error).lower() for words in OUT_OF_MEMORY)\n",
              "    return isinstance(error, MemoryError)\n"),),
        ("tests/test_cli_errors.py",),
    ),
    Mutant(
        "residual-add-normed-by-its-own-layer",
        "each layer's second residual add is normed by the layer's own feed-forward norm instead of the next "
        "layer's input norm (the operations on the CPU, the residual kernel on CUDA)",
        (Edit("families/lfm2/model.py", "add_norm(h, r, self.layers[i + 1].operator_norm, self.residual_by_kernel)",
              "add_norm(h, r, layer.ffn_norm, self.residual_by_kernel)"),),
        ("tests/test_lfm2_rounds.py", "tests/test_lfm2_parity.py"),
    ),
    Mutant(
        "heads-kernel-at-the-first-lanes-position",
        "on CUDA, every lane's q and k heads are rotated at the first lane's positions (the heads kernel's path)",
        (Edit("families/lfm2/model.py", "self.k_layernorm.weight, layout.offsets_array, heads=self.heads,",
              "self.k_layernorm.weight, layout.offsets_array * 0 + layout.offsets_array[0], heads=self.heads,"),),
        ("tests/test_heads_kernel.py",),
    ),
    Mutant(
        "drafter-context-heads-kernel-at-position-zero",
        "on CUDA, a drafter's appended context keys are rotated as if every row sat at position 0 (the heads "
        "kernel's path)",
        (Edit("families/lfm2/drafter/model.py", "return self._heads(x, offset, want_q=False)[1:]",
              "return self._heads(x, offset * 0, want_q=False)[1:]"),),
        ("tests/test_heads_kernel.py",),
    ),
)


class MutantError(RuntimeError):
    """A mutant cannot be applied as written (its snippet moved or repeats)."""


def mutated_sources(root: Path, mutant: Mutant) -> dict[str, str]:
    """The mutated text of each file the mutant edits, read from `root`; raises
    MutantError naming the mutant when a snippet is not found exactly once or the result
    does not compile."""
    texts: dict[str, str] = {}
    for edit in mutant.edits:
        if edit.path not in texts:
            path = root / edit.path
            if not path.is_file():
                raise MutantError(f"mutant {mutant.name}: {edit.path} does not exist")
            texts[edit.path] = path.read_text()
        count = texts[edit.path].count(edit.old)
        if count != 1:
            raise MutantError(f"mutant {mutant.name}: snippet found {count} times in {edit.path} (wanted exactly once): "
                              f"{edit.old.strip()[:100]!r}")
        texts[edit.path] = texts[edit.path].replace(edit.old, edit.new)
    for path, text in texts.items():
        try:
            compile(text, path, "exec")
        except SyntaxError as e:
            raise MutantError(f"mutant {mutant.name}: the mutated {path} does not compile: {e}") from e
    return texts


def apply(root: Path, mutant: Mutant) -> None:
    for path, text in mutated_sources(root, mutant).items():
        (root / path).write_text(text)


# ---- the scratch copies --------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout


def snapshot(destination: Path, source: str) -> str:
    """The repository into `destination`, once for the whole check (commits and edits
    landing meanwhile change nothing): a clone sharing this checkout's objects (the
    tests read the commit they run at) at the commit HEAD names now, and with `source`
    "worktree" the working tree's tracked files over it. Returns where they came from,
    in words."""
    commit = git("rev-parse", "HEAD").strip()
    subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(REPO), str(destination)], check=True)
    subprocess.run(["git", "-C", str(destination), "checkout", "--quiet", "--detach", commit], check=True)
    if source == "HEAD":
        return f"commit {commit[:7]} (as committed)"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    for name in git("ls-files", "-z").split("\0"):
        if not name:
            continue
        origin, target = REPO / name, destination / name
        if not origin.exists() and not origin.is_symlink():  # deleted in the working tree
            target.unlink(missing_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, target, follow_symlinks=False)
    return f"commit {commit[:7]}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else " (working tree clean)")


GUARD_CODE = f'''"""Written by bench/mutants.py: the run must import the scratch copy's code."""
import os

import pytest


def pytest_configure(config):
    import {", ".join(PACKAGES)}

    root = os.path.realpath(os.environ["LANESERVE_MUTANTS_ROOT"])
    for module in ({", ".join(PACKAGES)}):
        where = os.path.realpath(module.__file__)
        if not where.startswith(root + os.sep):
            raise pytest.UsageError(f"{GUARD_SENTINEL}: {{module.__name__}} imported from {{where}}, not from the copy {{root}}")
'''


@dataclass
class Run:
    outcome: str  # "passed", "failed", "timeout", "error"
    failures: list[str]  # failing test ids, in the order pytest reported them
    seconds: float
    output: str


def ordered_test_files(root: Path, first: tuple[str, ...]) -> list[str]:
    """Every test file of the copy, `first` (those that exist) leading; not this check's
    own tests, which test its mechanics, not the code the mutants plant bugs in."""
    every = sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py") if p.name != SELF_TEST)
    leading = [f for f in first if f in every]
    return leading + [f for f in every if f not in leading]


def run_pytest(root: Path, args: list[str], timeout: float) -> Run:
    """`python -m pytest -q -p no:cacheprovider ARGS` in the copy at `root`, importing the copy."""
    (root / f"{GUARD_PLUGIN}.py").write_text(GUARD_CODE)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["LANESERVE_MUTANTS_ROOT"] = str(root)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", GUARD_PLUGIN, *args]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the run's own process group (servers it started too)
        output, _ = process.communicate()
        return Run("timeout", [], time.monotonic() - started, output)
    except BaseException:  # interrupted: take the run down with the check
        os.killpg(process.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - started
    if GUARD_SENTINEL in output:
        line = next(line for line in output.splitlines() if GUARD_SENTINEL in line)
        raise MutantError(f"the scratch run imported code from outside the copy: {line.strip()}")
    # Failing tests as the short summary lists them (captured logs also hold "ERROR" lines).
    summary = output[output.rfind("short test summary info"):] if "short test summary info" in output else ""
    failures = re.findall(r"^(?:FAILED|ERROR) (\S.*?)(?: - .*)?$", summary, flags=re.MULTILINE)
    if process.returncode == 0:
        return Run("passed", [], seconds, output)
    if process.returncode in (1, 2) and failures:  # tests failed (1), or errored in collection (2)
        return Run("failed", failures, seconds, output)
    return Run("error", [f"pytest exit status {process.returncode}"], seconds, output)


def copy_of(pristine: Path, scratch: Path, name: str, mutant: Mutant | None = None) -> Path:
    root = scratch / name
    shutil.copytree(pristine, root, symlinks=True)
    if mutant is not None:
        apply(root, mutant)
    return root


@dataclass
class Verdict:
    caught: str  # "yes", "no", "timeout", "error", "unconfirmed"
    test: str  # the first confirmed failing test (or why none)
    seconds: float
    log: str


def check_control(root: Path, timeout: float) -> tuple[Run, list[str]]:
    """The unmutated suite, whole (not stopping at a failure); a test that fails is run
    again alone, and one that then passes is reported as flaky. Returns the run and the
    flaky tests."""
    run = run_pytest(root, ordered_test_files(root, ()), timeout)
    flaky = []
    if run.outcome == "failed":
        again = [(test, run_pytest(root, [test], timeout)) for test in run.failures]
        if all(rerun.outcome == "passed" for _, rerun in again):
            flaky = run.failures
            run = Run("passed", [], run.seconds, run.output + "".join(rerun.output for _, rerun in again))
    return run, flaky


def check_mutant(mutant: Mutant, root: Path, control: Path, timeout: float, attempts: int = 3) -> Verdict:
    """The suite against the mutant, stopping at the first failure; a catch counts once
    the failing test fails again alone on the mutant and passes alone on the unmutated
    copy (a flaky test is not a catch: it is deselected and the suite runs on)."""
    started, log, doubtful = time.monotonic(), "", []
    for _ in range(attempts):
        deselect = [arg for test in doubtful for arg in ("--deselect", test)]
        run = run_pytest(root, ["-x", *deselect, *ordered_test_files(root, mutant.catchers)], timeout)
        log += run.output
        if run.outcome != "failed":
            why = {"passed": "no", "timeout": "timeout", "error": "error"}[run.outcome]
            detail = "; ".join(run.failures) or ("every test passed" if run.outcome == "passed" else f"past {timeout:.0f} s")
            if doubtful:
                detail += f" (unconfirmed failures deselected: {', '.join(doubtful)})"
            return Verdict(why, detail, time.monotonic() - started, log)
        test = run.failures[0]
        on_mutant = run_pytest(root, [test], timeout)
        unmutated = run_pytest(control, [test], timeout)
        log += on_mutant.output + unmutated.output
        if on_mutant.outcome == "failed" and unmutated.outcome == "passed":
            return Verdict("yes", test, time.monotonic() - started, log)
        doubtful.append(test)
    return Verdict("unconfirmed", f"failures not confirmed: {', '.join(doubtful)}", time.monotonic() - started, log)


# ---- the report ----------------------------------------------------------------------


def shown_command(argv: list[str]) -> str:
    """The command as run, less the options that only say where output goes."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--out", "--logs"):
            skip = True
        elif not arg.startswith(("--out=", "--logs=")):
            shown.append(arg)
    return " ".join(["python -m bench.mutants", *shown])


def report(argv: list[str], where: str, control: Run | None, flaky: list[str], rows: list[tuple[Mutant, Verdict]]) -> str:
    caught = sum(verdict.caught == "yes" for _, verdict in rows)
    if control is None:
        control_line = "skipped"
    else:
        control_line = f"{control.outcome}, {control.seconds:.0f} s"
        if flaky:
            control_line += f" (failed at first and passed alone on a rerun, so flaky: {', '.join(f'`{t}`' for t in flaky)})"
    lines = [
        (f"`{shown_command(argv)}` at {where}, "
         f"{time.strftime('%Y-%m-%d %H:%M %Z')}: {caught} of {len(rows)} mutants caught."),
        "",
        f"Control (the unmutated copy, whole suite): {control_line}.",
        "",
        "| mutant | file | caught? | first failing test | seconds |",
        "|---|---|---|---|---:|",
    ]
    words = {"yes": "yes", "no": "**no**", "timeout": "**no** (timed out)", "error": "**no** (pytest error)",
             "unconfirmed": "**no** (unconfirmed)"}
    for mutant, verdict in rows:
        test = f"`{verdict.test}`" if verdict.caught == "yes" else verdict.test
        lines.append(f"| {mutant.name} | {mutant.files} | {words[verdict.caught]} | {test} | {verdict.seconds:.0f} |")
    lines += ["", "What each mutant plants:", ""]
    lines += [f"- {mutant.name}: {mutant.plants}." for mutant, _ in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="only check that every mutant applies, and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant only (repeatable)")
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per suite run (default 1800)")
    parser.add_argument("--source", choices=("worktree", "HEAD"), default="worktree",
                        help="copy the working tree's tracked files (default) or the commit HEAD names")
    parser.add_argument("--logs", type=Path, help="write each run's pytest output into this directory")
    parser.add_argument("--skip-control", action="store_true", help="do not run the whole unmutated suite first")
    args = parser.parse_args(argv)
    # A plain `kill` ends the check as Ctrl-C would: the run in progress and the scratch copies go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:40} {mutant.files}\n    {mutant.plants}")
        return 0
    unknown = [name for name in args.only or () if name not in {m.name for m in MUTANTS}]
    if unknown:
        print(f"mutants: no mutant named {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    selected = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)

    def log(name: str, text: str) -> None:
        if args.logs:
            (args.logs / f"{name}.log").write_text(text)

    with tempfile.TemporaryDirectory(prefix="laneserve-mutants-") as scratch_dir:
        scratch = Path(scratch_dir)
        pristine = scratch / "pristine"
        where = snapshot(pristine, args.source)
        try:
            for mutant in selected:  # every snippet, before anything runs
                mutated_sources(pristine, mutant)
        except MutantError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
        print(f"mutants: {len(selected)} mutants apply at {where}", flush=True)
        if args.check:
            return 0
        try:
            control_root = copy_of(pristine, scratch, "control")
            control, flaky = None, []
            if not args.skip_control:
                control, flaky = check_control(control_root, args.timeout)
                log("control", control.output)
                print(f"control: {control.outcome} in {control.seconds:.0f} s"
                      + (f", flaky: {', '.join(flaky)}" if flaky else ""), flush=True)
                if control.outcome != "passed":
                    print(f"mutants: the unmutated copy does not pass ({control.outcome}: {'; '.join(control.failures)}); "
                          "no mutant was run\n" + control.output[-3000:], file=sys.stderr)
                    return 3
            rows = []
            for mutant in selected:
                root = copy_of(pristine, scratch, mutant.name, mutant)
                verdict = check_mutant(mutant, root, control_root, args.timeout)
                shutil.rmtree(root)
                log(mutant.name, verdict.log)
                rows.append((mutant, verdict))
                print(f"{mutant.name}: {'caught' if verdict.caught == 'yes' else 'SURVIVED (' + verdict.caught + ')'} "
                      f"in {verdict.seconds:.0f} s: {verdict.test}", flush=True)
        except MutantError as e:
            print(f"mutants: {e}", file=sys.stderr)
            return 2
    text = report(argv, where, control, flaky, rows)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    return 0 if all(verdict.caught == "yes" for _, verdict in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

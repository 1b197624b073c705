"""`laneserve serve` with the scripted-acceptance drafter: for measurement only.

    python -m bench.serve_scripted --model DIR --draft-model DIR [--profile published|falling] [laneserve serve's flags]

Random-weight checkpoints of the real shapes have the real costs but accept no drafts.
This server is laneserve's own `serve` (HTTP, engine, guards and pricing as they are)
with the drafter wrapped in bench/scripted.py's ScriptedDrafter: every finished
`draft: false` reply records its prompt and continuation, and a later drafting request
for the same prompt is proposed that continuation, each draft surviving with the
published profile's chance for its position (`--profile falling`: acceptance that
falls with context). The real drafter still runs its forward every drafting round, so
rounds cost what they would, and the target verifies every draft, so replies stay exact.
A drafting request for a prompt with no recorded plain reply gets drafts the target
rejects. bench_concurrent sends every prompt with `draft: false` first.

Never a way to serve users: the acceptance it shows is scripted.
"""

from __future__ import annotations

import argparse
import sys

from daemon import cli
from daemon.serve import run_serve
from families.lfm2 import CheckpointError
from lanes.engine import Engine, QueueFull, RequestError
from lanes.lane import FinishReason, LaneEvent, Request

from .scripted import ScriptedDrafter, falling_with_context_profile, published_profile

PROFILES = {"published": published_profile, "falling": falling_with_context_profile}


class RecordingEngine(Engine):
    """An engine whose scripted drafter learns each finished plain reply."""

    def submit(self, request: Request) -> None:
        if not request.draft:
            request.on_event = self._recording(request, request.on_event)
        super().submit(request)

    def _recording(self, request: Request, deliver):
        def on_event(event: LaneEvent) -> None:  # on the engine thread, where the drafter proposes
            if event.completion is not None and event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.drafter.record(request.prompt + event.completion.token_ids)
            if deliver is not None:
                deliver(event)

        return on_event


def scripted_engine(profile: str):
    """An Engine builder for `run_serve`: the drafter wrapped, plain replies recorded."""

    def build(target, tokenizer, eos_ids, drafter, config) -> Engine:
        if drafter is None:
            raise cli.UsageError("the scripted server needs --draft-model (and no --no-draft)")
        scripted = ScriptedDrafter(drafter, [], PROFILES[profile](), target.vocab_size)
        return RecordingEngine(target, tokenizer, eos_ids, scripted, config)

    return build


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--profile", choices=sorted(PROFILES), default="published")
    own.add_argument("--log-level", default="INFO")
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
    serve_args = cli.parser().parse_args(["--log-level", args.log_level, "serve", *rest])
    # As `laneserve serve`, errors a user can act on included; only the engine differs.
    try:
        cli.configure_logging(serve_args.log_level)
        return run_serve(serve_args, scripted_engine(args.profile))
    except (CheckpointError, RequestError, QueueFull, cli.UsageError, ValueError, OSError) as e:
        print(f"serve_scripted: error: {e}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    cli.exit_process(main())

"""An earlier commit's code, to run beside this one on a machine without the history.

    python -m bench.export_code COMMIT DIR

Writes the commit's tracked files to DIR (`git archive`), leaving out the embedded
default's weights (25 MB; the benchmarks that compare code load checkpoints of their
own) and bench/results (what runs leave, not code), and the commit's short hash to
DIR/COMMIT, which `bench.provenance` cannot read from a directory that is not a
checkout. `bench.backend_settings` runs such a directory as a `code=DIR` setting, its
processes taking turns with this checkout's; on the GPU machine, put DIR under
.device/ (ignored by git) and carry it.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from bench.provenance import REPO

COMMIT_FILE = "COMMIT"
LEFT_OUT = (":(exclude)families/lfm2/default/*/*.safetensors", ":(exclude)bench/results")


def export_code(commit: str, out: str | Path) -> str:
    """COMMIT's code into OUT (a new or empty directory) -> its short hash."""
    git = ["git", "-C", str(REPO)]
    short = subprocess.run([*git, "rev-parse", "--short", "--verify", f"{commit}^{{commit}}"], capture_output=True,
                           text=True).stdout.strip()
    if not short:
        raise ValueError(f"{commit!r} names no commit of this repository")
    out = Path(out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise ValueError(f"{out} is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run([*git, "archive", "--format=tar", short, "--", ".", *LEFT_OUT], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    (out / COMMIT_FILE).write_text(short + "\n")
    return short


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commit")
    p.add_argument("out", help="directory to write (new, or empty)")
    args = p.parse_args(argv)
    try:
        short = export_code(args.commit, args.out)
    except ValueError as e:
        p.error(str(e))
    print(f"{short} -> {args.out}")


if __name__ == "__main__":
    main()

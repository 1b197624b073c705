"""Every bench result names its command, commit and machine (bench/provenance.py), written
by the script that produced it."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from bench import provenance as prov

BENCH = Path(prov.__file__).parent
REPO = BENCH.parent
COMMIT = re.compile(r"^[0-9a-f]{7,40}(-dirty)?$")

# bench modules that write files but no result: why each needs no provenance.
NOT_RESULTS = {
    "random_checkpoint.py": "writes a checkpoint, not a result",
    "mutants.py": "its report names its own command, source tree and time",
    "export_code.py": "writes a commit's code and its hash, which is the provenance a code= setting records",
}


def test_the_record_has_every_field():
    record = prov.provenance(["--out", "x y"], "bench.bench_target")
    assert record["command"] == "python -m bench.bench_target --out 'x y'"
    assert COMMIT.match(record["commit"]), record["commit"]
    assert f"{os.cpu_count()} CPUs" in record["machine"] and re.search(r"; (cpu|gpu)", record["machine"])
    assert re.match(r"^\d+\.\d+", record["mlx"])
    assert datetime.fromisoformat(record["date"]).utcoffset().total_seconds() == 0
    line = prov.markdown_line(record)
    assert line.startswith("- command: `python -m bench.bench_target --out 'x y'` at commit ") and record["machine"] in line


def test_commit_named_where_git_is_not(monkeypatch, tmp_path):
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert prov.commit() == "abc1234"
    monkeypatch.delenv("BENCH_COMMIT")
    monkeypatch.setattr(prov, "REPO", tmp_path)  # not a git checkout
    assert prov.commit().startswith("unknown")


def test_pythonpath_inside_the_repo_is_part_of_the_command(monkeypatch):
    inside = REPO / ".gpu"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/elsewhere", str(REPO), str(inside)]))
    assert prov.command_line(["--lanes", "1"], "bench.bench_step") == "PYTHONPATH=.gpu python -m bench.bench_step --lanes 1"


def test_median_range_formats_a_spread_as_the_reports_print_it():
    s = prov.spread([1.4, 1.234, 1.1])
    assert prov.median_range(s) == "1.23 [1.10-1.40]"
    assert prov.median_range(s, 3, "x") == "1.234x [1.100-1.400]"  # the unit after the median only
    assert prov.median_range(prov.spread([0.0125, 0.002, 0.5]), 1, scale=1e3) == "12.5 [2.0-500.0]"
    assert prov.median_range(prov.spread([0.25, 0.125, 0.5]), 0, percent=True) == "25% [12%-50%]"
    assert prov.median_range(prov.spread([0.25, 0.125, 0.5]), 1, percent=True) == "25.0% [12.5%-50.0%]"


def test_a_writer_records_its_own_run(dense_dir, tmp_path):
    """bench_load_memory (the cheapest writer: two short subprocesses) run as a user runs it."""
    out = tmp_path / "out"
    args = ["--model", str(dense_dir), "--out", str(out), "--name", "tiny", "--loaders", "laneserve"]
    env = {k: v for k, v in os.environ.items() if k not in ("BENCH_COMMIT", "PYTHONPATH")}
    subprocess.run([sys.executable, "-m", "bench.bench_load_memory", *args], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=300)
    result = json.loads((out / "tiny.json").read_text())
    assert result["command"] == shlex.join(["python", "-m", "bench.bench_load_memory", *args])
    assert COMMIT.match(result["commit"]) and "CPUs" in result["machine"] and result["mlx"] and result["date"]
    assert prov.markdown_line(result) in (out / "tiny.md").read_text()


def writes_files(tree: ast.Module) -> bool:
    """Calls write_text or write_result, or open() with a mode that writes."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in ("write_text", "write_result"):
            return True
        modes = [a.value for a in node.args[1:2] + [k.value for k in node.keywords if k.arg == "mode"] if isinstance(a, ast.Constant)]
        if name == "open" and any(isinstance(m, str) and ("w" in m or "a" in m) for m in modes):
            return True
    return False


def imports_provenance(tree: ast.Module) -> bool:
    """`from bench.provenance import ...` or `from .provenance import ...`."""
    return any(isinstance(node, ast.ImportFrom) and node.module in ("bench.provenance", "provenance") for node in ast.walk(tree))


def test_every_result_writer_uses_the_helper():
    writers = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.name in NOT_RESULTS or path.name == "provenance.py":
            continue
        tree = ast.parse(path.read_text())
        if writes_files(tree):
            writers[path.name] = imports_provenance(tree)
    assert {"bench_target.py", "bench_default.py", "bench_engine.py", "bench_concurrent.py", "soak.py", "exact.py"} <= set(writers)
    assert [name for name, uses in writers.items() if not uses] == []

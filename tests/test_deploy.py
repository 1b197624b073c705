"""`laneserve service` (launchd plist, systemd unit, the commands that load them) and the
wired-memory arithmetic. Everything runs through --dry-run, as it does on Linux."""

from __future__ import annotations

import configparser
import os
import plistlib
import re
import shlex
import sys
from pathlib import Path

import logging

import mlx.core as mx
import pytest

from daemon.cli import main, parser
from daemon.service import DEFAULT_LABEL, EXIT_MARGIN_S, entry_point, systemd_word
from daemon.wired import GIB, MIB, NEAR, WiredPlan, bytes_needed, kv_bytes_per_position, weight_bytes, wire_for_serving, wireable_ceiling
from families.lfm2 import open_target
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny_drafter import make_tiny_drafter

SERVE_ARGS = ["--model", "/srv/models/LFM2-2.6B", "--port", "8001", "--max-streams", "8"]


def dry_run(capsys, *args) -> str:
    assert main(["service", *args]) == 0
    return capsys.readouterr().out


def written(out: str, suffix: str) -> tuple[Path, str]:
    """The one file a dry run would write (path ending in `suffix`) and its text."""
    match = re.search(r"^# write (\S+" + re.escape(suffix) + r") \(mode \d+\):\n(.*?)(?=^(?:# |mkdir |launchctl |systemctl |rm )|\Z)",
                      out, re.S | re.M)
    assert match, out
    return Path(match.group(1)), match.group(2)


def commands(out: str, tool: str) -> list[list[str]]:
    return [shlex.split(line.split("  #")[0]) for line in out.splitlines() if line.startswith(tool + " ")]


def serve_default_drain() -> float:
    return parser().parse_args(["serve"]).drain_timeout


# ---- launchd ---------------------------------------------------------------------------


@pytest.mark.parametrize("domain", ["--system", "--user"])
def test_plist_has_every_key_and_runs_the_entry_point(capsys, domain):
    out = dry_run(capsys, "install", domain, "--dry-run", "--", *SERVE_ARGS, "--drain-timeout", "45")
    path, text = written(out, ".plist")
    plist = plistlib.loads(text.encode())
    assert path.name == f"{DEFAULT_LABEL}.plist"
    assert plist["Label"] == DEFAULT_LABEL
    entry = entry_point()
    assert plist["ProgramArguments"] == [*entry, "serve", *SERVE_ARGS, "--drain-timeout", "45"]
    # In this environment the entry point is the installed console script of this venv.
    assert entry == [str(Path(sys.executable).parent / "laneserve")] and os.access(entry[0], os.X_OK)
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] > 0
    assert plist["ProcessType"] == "Interactive"
    assert plist["ExitTimeOut"] == 45 + EXIT_MARGIN_S
    assert plist["Umask"] == 0o027
    assert plist["EnvironmentVariables"] == {"PYTHONUNBUFFERED": "1"}
    logs = Path(plist["StandardOutPath"]).parent
    assert logs == Path(plist["StandardErrorPath"]).parent and logs.is_absolute()
    assert f"mkdir -p {logs}" in out


def test_exit_timeout_follows_serves_default_drain(capsys):
    out = dry_run(capsys, "install", "--user", "--dry-run")
    plist = plistlib.loads(written(out, ".plist")[1].encode())
    assert plist["ExitTimeOut"] > serve_default_drain()
    assert plist["ProgramArguments"][-1] == "serve"


def test_launchctl_commands_per_domain(capsys):
    system = dry_run(capsys, "install", "--system", "--dry-run", "--", *SERVE_ARGS)
    assert written(system, ".plist")[0] == Path(f"/Library/LaunchDaemons/{DEFAULT_LABEL}.plist")
    assert commands(system, "launchctl") == [
        ["launchctl", "bootout", f"system/{DEFAULT_LABEL}"],
        ["launchctl", "bootstrap", "system", f"/Library/LaunchDaemons/{DEFAULT_LABEL}.plist"],
        ["launchctl", "kickstart", f"system/{DEFAULT_LABEL}"],
    ]
    user = dry_run(capsys, "install", "--user", "--label", "org.example.lfm", "--dry-run")
    gui = f"gui/{os.getuid()}"
    agent = Path.home() / "Library/LaunchAgents/org.example.lfm.plist"
    assert written(user, ".plist")[0] == agent
    assert commands(user, "launchctl") == [
        ["launchctl", "bootout", f"{gui}/org.example.lfm"],
        ["launchctl", "bootstrap", gui, str(agent)],
        ["launchctl", "kickstart", f"{gui}/org.example.lfm"],
    ]
    assert commands(dry_run(capsys, "uninstall", "--system", "--dry-run"), "launchctl") == [
        ["launchctl", "bootout", f"system/{DEFAULT_LABEL}"]]
    assert commands(dry_run(capsys, "status", "--user", "--dry-run"), "launchctl") == [
        ["launchctl", "print", f"{gui}/{DEFAULT_LABEL}"]]


def test_api_key_is_never_written(capsys, monkeypatch):
    monkeypatch.setenv("LANESERVE_TEST_KEY", "sk-very-secret")
    out = dry_run(capsys, "install", "--system", "--dry-run", "--", "--api-key-env", "LANESERVE_TEST_KEY")
    plist = plistlib.loads(written(out, ".plist")[1].encode())
    assert "sk-very-secret" not in out
    assert "LANESERVE_TEST_KEY" not in plist["EnvironmentVariables"]
    assert "launchctl setenv LANESERVE_TEST_KEY" in out  # says how to supply it instead
    unit = dry_run(capsys, "install", "--systemd", "--system", "--dry-run", "--", "--api-key-env", "LANESERVE_TEST_KEY")
    assert "sk-very-secret" not in unit
    service = parse_unit(written(unit, ".service")[1])["Service"]
    assert service["EnvironmentFile"] == f"/etc/laneserve/{DEFAULT_LABEL}.env"


def test_bad_serve_arguments_and_labels_are_refused(capsys):
    with pytest.raises(SystemExit):  # serve's own parser rejects the typo before anything is written
        main(["service", "install", "--dry-run", "--", "--max-steams", "8"])
    assert main(["service", "install", "--dry-run", "--", "--model", "relative/dir"]) == 2
    assert main(["service", "install", "--dry-run", "--label", "../evil"]) == 2
    assert "absolute path" in capsys.readouterr().err


# ---- systemd ---------------------------------------------------------------------------


def parse_unit(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # systemd keys are case-sensitive
    unit.read_string(text)
    return unit


@pytest.mark.parametrize("domain", ["--system", "--user"])
def test_systemd_unit_has_the_keys(capsys, domain):
    out = dry_run(capsys, "install", "--systemd", domain, "--dry-run", "--", *SERVE_ARGS, "--drain-timeout=20")
    path, text = written(out, ".service")
    unit = parse_unit(text)
    service = unit["Service"]
    assert shlex.split(service["ExecStart"]) == [*entry_point(), "serve", *SERVE_ARGS, "--drain-timeout=20"]
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) == 20 + EXIT_MARGIN_S
    assert service["Restart"] == "on-failure"
    assert service["Environment"] == "PYTHONUNBUFFERED=1"
    assert "EnvironmentFile" not in service
    systemctl = ["systemctl"] if domain == "--system" else ["systemctl", "--user"]
    unit_name = f"{DEFAULT_LABEL}.service"
    if domain == "--system":
        assert path == Path("/etc/systemd/system") / unit_name
        assert unit["Install"]["WantedBy"] == "multi-user.target"
    else:
        assert path == Path.home() / ".config/systemd/user" / unit_name
        assert unit["Install"]["WantedBy"] == "default.target"
    assert commands(out, "systemctl") == [systemctl + ["daemon-reload"], systemctl + ["enable", unit_name],
                                          systemctl + ["restart", unit_name]]
    assert commands(dry_run(capsys, "uninstall", "--systemd", domain, "--dry-run"), "systemctl") == [
        systemctl + ["disable", "--now", unit_name], systemctl + ["daemon-reload"]]
    assert commands(dry_run(capsys, "status", "--systemd", domain, "--dry-run"), "systemctl") == [
        systemctl + ["status", unit_name]]


def test_systemd_words_survive_its_quoting():
    # systemd unquotes like a shell for these and expands `%` and `$` unless doubled.
    words = ["/opt/My Models/lfm2", 'say "hi"', "50%", "$HOME", "plain"]
    quoted = " ".join(systemd_word(w) for w in words)
    assert quoted.count("%%") == 1 and "$$HOME" in quoted
    unescaped = [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(quoted)]
    assert unescaped == words


# ---- wired memory ----------------------------------------------------------------------


def test_bytes_needed_counts_weights_kv_and_headroom():
    assert bytes_needed(1000, 200, 10, 50, headroom_percent=0) == 1700
    assert bytes_needed(1000, 0, 10, 50, headroom_percent=10) == 1650
    assert bytes_needed(1001, 0, 0, 0, headroom_percent=10) == 1102  # 100.1 bytes of headroom round up
    # 2.6B shape in bf16: 5.4 GB weights, 16 lanes x 6 attention layers x 8 kv heads x 64 x 2 (K, V) x 2 bytes
    per_position = 16 * 6 * 8 * 64 * 2 * 2
    assert bytes_needed(5_400_000_000, 0, per_position, 32_768) == pytest.approx((5.4e9 + per_position * 32_768) * 1.1, abs=1)
    assert bytes_needed(5_400_000_000, 0, per_position, 32_768) > 12 * GIB


def test_plan_caps_at_the_recommended_working_set():
    small = WiredPlan(needed=10 * GIB, recommended=48 * GIB, memory=64 * GIB)
    assert small.limit == 10 * GIB and not small.near_limit and small.warning() is None
    big = WiredPlan(needed=47 * GIB, recommended=48 * GIB, memory=64 * GIB)
    assert big.limit == 47 * GIB and big.near_limit
    over = WiredPlan(needed=50 * GIB, recommended=48 * GIB, memory=64 * GIB)
    assert over.limit == 48 * GIB


def test_near_limit_warning_names_a_sysctl_that_clears_it():
    plan = WiredPlan(needed=47 * GIB, recommended=48 * GIB, memory=64 * GIB)
    n = plan.sysctl_mb
    assert f"sudo sysctl iogpu.wired_limit_mb={n}" in plan.warning()
    assert n % 1024 == 0 and n * MIB <= wireable_ceiling(64 * GIB)
    # With the system limit raised to N, the same need is no longer near it.
    raised = WiredPlan(plan.needed, n * MIB, plan.memory)
    assert not raised.near_limit and raised.limit == plan.needed


def test_sysctl_never_takes_what_macos_needs():
    assert wireable_ceiling(64 * GIB) == 56 * GIB and wireable_ceiling(16 * GIB) == 12 * GIB
    # Needs 11 GB of a 16 GB Mac: the raise stops at the ceiling, and still holds the need.
    tight = WiredPlan(needed=11 * GIB, recommended=int(10.7 * GIB), memory=16 * GIB)
    assert tight.sysctl_mb == 12 * 1024 and tight.needed <= tight.sysctl_mb * MIB
    assert "iogpu.wired_limit_mb=12288" in tight.warning()
    # Needs more than any setting could wire: the warning says what to shrink instead.
    hopeless = WiredPlan(needed=14 * GIB, recommended=int(10.7 * GIB), memory=16 * GIB)
    assert hopeless.sysctl_mb is None
    assert "sysctl" not in hopeless.warning() and "--max-model-len" in hopeless.warning()
    assert NEAR * hopeless.recommended < hopeless.needed


def test_wiring_sets_the_need_and_restores_the_previous_limit(dense_dir, tmp_path, monkeypatch, caplog):
    """The startup glue against a simulated Metal device (this machine has none)."""
    loaded = open_target(dense_dir, dtype="float32", max_lanes=4)
    drafter = load_drafter(make_tiny_drafter(tmp_path / "drafter", dense_dir, seed=3), loaded.target.model,
                           loaded.target.config, max_lanes=4)
    need = bytes_needed(weight_bytes(loaded.target.model), weight_bytes(drafter.model),
                        kv_bytes_per_position([*loaded.target.kv.values(), *drafter.kv]), 256)
    assert weight_bytes(drafter.model) > 0 and need > weight_bytes(loaded.target.model) + weight_bytes(drafter.model)
    assert not mx.metal.is_available()
    assert wire_for_serving(loaded.target, drafter, 256, logging.getLogger("t"))() is None  # nothing to do off Metal

    limits = [7 * MIB]  # the limit in force before startup

    def set_wired_limit(limit):
        limits.append(limit)
        return limits[-2]

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 2 * need, "memory_size": 4 * need})
    monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
    with caplog.at_level(logging.INFO):
        restore = wire_for_serving(loaded.target, drafter, 256, logging.getLogger("t"))
        assert limits == [7 * MIB, need]
        restore()
    assert limits == [7 * MIB, need, 7 * MIB]
    assert f"for {need // MIB} MB needed" in caplog.text and "WARNING" not in caplog.text

    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": need, "memory_size": 2 * need})
    caplog.clear()
    wire_for_serving(loaded.target, drafter, 256, logging.getLogger("t"))
    assert limits[-1] == need and "near the recommended working set" in caplog.text

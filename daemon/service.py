"""`laneserve service`: run `laneserve serve` as a launchd job (macOS) or a systemd unit (Linux).

    laneserve service install   [--system|--user] [--label L] [--systemd] [--log-dir DIR] [--dry-run] [-- SERVE ARGS...]
    laneserve service uninstall [--system|--user] [--label L] [--systemd] [--dry-run]
    laneserve service status    [--system|--user] [--label L] [--systemd] [--dry-run]

`install` writes the job (a plist made with plistlib, or a unit file) and loads it;
`--dry-run` prints the file and the commands instead, which is what tests and Linux use
for the plist. The serve arguments are checked with `laneserve serve`'s own parser before
anything is written, so a typo fails here and not in a restart loop.

The job runs the `laneserve` console script beside the interpreter doing the install (a
service starts in `/` with a bare PATH, so the path is absolute, and the environment that
installs is the one that serves), else the `laneserve` on PATH, else this interpreter
with `-m daemon.cli`. The interpreter path is kept unresolved: a virtual environment's
`python` is a symlink, and resolving it would leave the environment's packages behind.

Secrets never go into the job file (a LaunchDaemon's plist must be world-readable): the
variable named by `--api-key-env` is left out of EnvironmentVariables. deploy/README.md
says how to hand the key to launchd or systemd.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LABEL = "com.laneserve.daemon"
# Past the drain deadline, serve still finishes the remaining streams with an error
# event, flushes its logs and restores the wired limit before it exits.
EXIT_MARGIN_S = 15
THROTTLE_S = 10  # launchd restarts a failed job at most this often; systemd waits as long
UMASK = 0o027  # files the daemon creates: no access for others
ENVIRONMENT = {"PYTHONUNBUFFERED": "1"}  # log lines reach the log files as they are written


class ServiceError(ValueError):
    """A service command that cannot be carried out as given (the command line prints it
    as one line, exit status 2)."""


# ---- what a command does: steps printed by --dry-run or carried out -------------------


@dataclass(frozen=True)
class MakeDir:
    path: Path

    def describe(self) -> str:
        return shlex.join(["mkdir", "-p", str(self.path)])

    def apply(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class Write:
    path: Path
    text: str
    mode: int = 0o644

    def describe(self) -> str:
        return f"# write {self.path} (mode {self.mode:o}):\n{self.text.rstrip()}"

    def apply(self) -> None:
        self.path.write_text(self.text)
        self.path.chmod(self.mode)


@dataclass(frozen=True)
class Remove:
    path: Path

    def describe(self) -> str:
        return shlex.join(["rm", "-f", str(self.path)])

    def apply(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    may_fail: bool = False  # e.g. unloading a job that was never loaded

    def describe(self) -> str:
        return shlex.join(self.argv) + ("  # may fail: not loaded" if self.may_fail else "")

    def apply(self) -> int:
        rc = subprocess.run(self.argv).returncode
        if rc and not self.may_fail:
            raise ServiceError(f"{shlex.join(self.argv)} exited with status {rc}")
        return rc


# ---- the job --------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    label: str
    system: bool  # system domain (starts at boot, root) or the user's session
    program: tuple[str, ...]  # entry point + "serve" + serve arguments
    drain_timeout: float
    log_dir: Path | None  # None with systemd: the journal
    secret_env: str | None  # the variable that holds the API key: never written

    @property
    def exit_timeout(self) -> int:
        return exit_timeout(self.drain_timeout)


def exit_timeout(drain_timeout: float) -> int:
    """Seconds between SIGTERM and SIGKILL: the drain deadline and the time serve needs after it."""
    return math.ceil(drain_timeout) + EXIT_MARGIN_S


def entry_point() -> list[str]:
    beside = Path(sys.executable).parent / "laneserve"
    if os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("laneserve")
    if found:
        return [os.path.abspath(found)]
    return [sys.executable, "-m", "daemon.cli"]


def check_label(label: str) -> str:
    # The label names files, so it must not hold a path separator or anything odd.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", label):
        raise ServiceError(f"--label must be letters, digits, '.', '_' or '-' (reverse-DNS style), got {label!r}")
    return label


# ---- launchd ----------------------------------------------------------------------------


def launchd_plist(job: Job) -> dict:
    return {
        "Label": job.label,
        "ProgramArguments": list(job.program),
        "RunAtLoad": True,
        # Restart after a crash; an exit 0 (a drain after SIGTERM) means it was asked to stop.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": THROTTLE_S,
        # Without it launchd treats the job as background work and throttles its CPU and I/O.
        "ProcessType": "Interactive",
        "ExitTimeOut": job.exit_timeout,
        "Umask": UMASK,
        "StandardOutPath": str(job.log_dir / f"{job.label}.out.log"),
        "StandardErrorPath": str(job.log_dir / f"{job.label}.err.log"),
        "EnvironmentVariables": dict(ENVIRONMENT),
    }


def launchd_domain(system: bool) -> str:
    return "system" if system else f"gui/{os.getuid()}"


def launchd_plist_path(label: str, system: bool) -> Path:
    folder = Path("/Library/LaunchDaemons") if system else Path.home() / "Library/LaunchAgents"
    return folder / f"{label}.plist"


def launchd_log_dir(system: bool) -> Path:
    return Path("/Library/Logs/laneserve") if system else Path.home() / "Library/Logs/laneserve"


def launchd_steps(action: str, job: Job) -> list:
    domain = launchd_domain(job.system)
    target = f"{domain}/{job.label}"
    plist = launchd_plist_path(job.label, job.system)
    if action == "install":
        text = plistlib.dumps(launchd_plist(job), sort_keys=False).decode()
        return [
            MakeDir(job.log_dir),
            MakeDir(plist.parent),
            Write(plist, text),
            Run(("launchctl", "bootout", target), may_fail=True),  # a reinstall replaces the loaded job
            Run(("launchctl", "bootstrap", domain, str(plist))),
            Run(("launchctl", "kickstart", target)),
        ]
    if action == "uninstall":
        return [Run(("launchctl", "bootout", target), may_fail=True), Remove(plist)]
    return [Run(("launchctl", "print", target))]


# ---- systemd ----------------------------------------------------------------------------


def systemd_word(word: str) -> str:
    """One ExecStart argument: systemd expands `%` specifiers and `$` variables, and
    splits on whitespace unless quoted."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not re.search(r"[\s\"'\\;]", word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_env_file(label: str, system: bool) -> Path:
    folder = Path("/etc/laneserve") if system else Path.home() / ".config/laneserve"
    return folder / f"{label}.env"


def systemd_unit(job: Job) -> str:
    unit = {"Description": f"laneserve ({job.label})"}
    if job.system:  # a user manager cannot order itself after system targets
        unit |= {"After": "network-online.target", "Wants": "network-online.target"}
    service = {
        "Type": "exec",
        "ExecStart": " ".join(systemd_word(w) for w in job.program),
        "Environment": " ".join(f"{k}={v}" for k, v in ENVIRONMENT.items()),
    }
    if job.secret_env:
        # The key lives in a root-only (or user-only) file that systemd reads at start;
        # no leading '-': a missing file fails the start loudly instead of serving without it.
        service["EnvironmentFile"] = str(systemd_env_file(job.label, job.system))
    service |= {
        "KillSignal": "SIGTERM",
        "TimeoutStopSec": str(job.exit_timeout),
        "Restart": "on-failure",
        "RestartSec": str(THROTTLE_S),
        "UMask": f"{UMASK:04o}",
    }
    if job.log_dir is not None:
        service["StandardOutput"] = f"append:{job.log_dir / f'{job.label}.out.log'}"
        service["StandardError"] = f"append:{job.log_dir / f'{job.label}.err.log'}"
    install = {"WantedBy": "multi-user.target" if job.system else "default.target"}
    sections = {"Unit": unit, "Service": service, "Install": install}
    return "\n".join(f"[{name}]\n" + "".join(f"{k}={v}\n" for k, v in items.items()) for name, items in sections.items())


def systemd_unit_path(label: str, system: bool) -> Path:
    folder = Path("/etc/systemd/system") if system else Path.home() / ".config/systemd/user"
    return folder / f"{label}.service"


def systemd_steps(action: str, job: Job) -> list:
    systemctl = ("systemctl",) if job.system else ("systemctl", "--user")
    unit = f"{job.label}.service"
    path = systemd_unit_path(job.label, job.system)
    if action == "install":
        steps = [MakeDir(path.parent), Write(path, systemd_unit(job))]
        if job.log_dir is not None:
            steps.append(MakeDir(job.log_dir))
        # restart rather than `enable --now`: a reinstall must start the new command line.
        return steps + [Run(systemctl + ("daemon-reload",)), Run(systemctl + ("enable", unit)), Run(systemctl + ("restart", unit))]
    if action == "uninstall":
        return [Run(systemctl + ("disable", "--now", unit), may_fail=True), Remove(path), Run(systemctl + ("daemon-reload",))]
    return [Run(systemctl + ("status", unit))]


# ---- the command line --------------------------------------------------------------------


def add_service(sub) -> None:
    p = sub.add_parser("service", help="install, remove or inspect laneserve as a launchd job or a systemd unit")
    common = argparse.ArgumentParser(add_help=False)
    domain = common.add_mutually_exclusive_group()
    domain.add_argument("--system", dest="system", action="store_true", default=None,
                        help="a system job: /Library/LaunchDaemons (launchd domain `system`, starts at boot) or "
                        "/etc/systemd/system; needs root (default when run as root)")
    domain.add_argument("--user", dest="system", action="store_false",
                        help="a job of the user's session: ~/Library/LaunchAgents (domain gui/UID) or "
                        "~/.config/systemd/user (default when not root)")
    common.add_argument("--label", default=DEFAULT_LABEL, help=f"job label and file name (default {DEFAULT_LABEL})")
    common.add_argument("--systemd", action="store_true", help="a systemd unit instead of a launchd plist (Linux)")
    common.add_argument("--dry-run", action="store_true", help="print the file and the commands instead of running them")
    actions = p.add_subparsers(dest="action", required=True, metavar="install|uninstall|status")
    install = actions.add_parser("install", parents=[common], help="write the job and start it")
    install.add_argument("--log-dir", type=Path, help="folder for stdout/stderr logs (launchd default: "
                         "/Library/Logs/laneserve or ~/Library/Logs/laneserve; systemd default: the journal)")
    install.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE ARGS",
                         help="arguments for `laneserve serve`, after `--`")
    actions.add_parser("uninstall", parents=[common], help="stop the job (it drains) and remove it")
    actions.add_parser("status", parents=[common], help="print the job's state")
    # The serve parser is looked up when the command runs: cli.py may register it after this one.
    p.set_defaults(run=run_service, serve_parser=lambda: sub.choices["serve"])


def make_job(args) -> Job:
    system = os.geteuid() == 0 if args.system is None else args.system
    label = check_label(args.label)
    serve_args = getattr(args, "serve_args", [])
    serve_args = serve_args[1:] if serve_args[:1] == ["--"] else serve_args
    serve = args.serve_parser().parse_args(serve_args)  # exits with serve's usage on a bad argument
    for flag in ("model", "draft_model"):
        path = getattr(serve, flag, None)
        if path is not None and not os.path.isabs(path):
            raise ServiceError(f"--{flag.replace('_', '-')} must be an absolute path: the service starts in /, got {path!r}")
    log_dir = getattr(args, "log_dir", None)
    if log_dir is None and not args.systemd:
        log_dir = launchd_log_dir(system)
    return Job(
        label=label,
        system=system,
        program=(*entry_point(), "serve", *serve_args),
        drain_timeout=serve.drain_timeout,
        log_dir=None if log_dir is None else log_dir.expanduser().absolute(),
        secret_env=serve.api_key_env,
    )


def secret_note(job: Job, systemd: bool) -> str | None:
    """How the key reaches the job, since the job file never holds it."""
    if job.secret_env is None:
        return None
    if systemd:
        path = systemd_env_file(job.label, job.system)
        return (f"# {job.secret_env} is read from {path} at start; create it readable only by its owner:\n"
                f"#   install -d -m 700 {path.parent} && install -m 600 /dev/null {path} && "
                f"echo '{job.secret_env}=...' >> {path}")
    sudo = "sudo " if job.system else ""
    return (f"# {job.secret_env} is not written into the plist; give it to launchd before the job starts "
            f"(again after a reboot):\n#   {sudo}launchctl setenv {job.secret_env} ...  (see deploy/README.md)")


def run_service(args) -> int:
    job = make_job(args)
    steps = (systemd_steps if args.systemd else launchd_steps)(args.action, job)
    note = secret_note(job, args.systemd) if args.action == "install" else None
    if args.dry_run:
        print("\n".join(step.describe() for step in steps))
        if note:
            print(note)
        return 0
    if not args.systemd and platform.system() != "Darwin":
        raise ServiceError("launchd runs on macOS: use --systemd on Linux, or --dry-run to see the plist")
    if job.system and os.geteuid() != 0:
        raise ServiceError("a system job needs root: run it with sudo, or use --user")
    if note:
        print(note, file=sys.stderr)
    rc = 0
    for step in steps:
        rc = step.apply() or 0
    return rc if args.action == "status" else 0

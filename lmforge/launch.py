"""`lmforge launch`: torchrun with exit statuses a scheduler can act on, and no launcher traceback.

    lmforge launch --nproc-per-node 2 train --config C --parallel.tp 2
    lmforge launch --nnodes 2 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train ...

Every option before the lmforge sub-command is torchrun's (`torchrun --help`); the sub-command and
what follows it are the workers' `python -m lmforge ...`. One is lmforge's own: `--lighthouse` (or
`--lighthouse=PORT`, default 29510) also starts a torchft lighthouse on this host for a fault-tolerant
job (fault_tolerance.*, lmforge.train.fault_tolerance), tells the workers its address
($TORCHFT_LIGHTHOUSE) and stops it when they are done; the job's other replica groups take the address
printed (fault_tolerance.lighthouse). The engine is torch's own launcher,
`torch.distributed.run.run`, in this process: the same agent, rendezvous, restarts and worker
environment as `torchrun`. What differs is only how its end is reported. torchrun's agent ends any
failure of its workers by raising `ChildFailedError`, which Python prints as a ~30-line traceback
of the launcher itself, and its exit status is 1 whatever the workers returned, so a scheduler
cannot tell a preempted run (workers exit 75 after their checkpoint) from a crash. Here:

| exit | meaning |
|---|---|
| 0 | every worker finished |
| 2 | a config or usage error (the workers printed it, once, on rank 0) |
| 74 | storage failure: a checkpoint or the final weights could not be written (`lmforge.ckpt.manager`) |
| 75 | preempted: a signal became a checkpoint, the run resumes with the same command (`lmforge.train.preempt`) |
| 128+N | a worker was killed by signal N (137: SIGKILL, e.g. the kernel's OOM killer) |
| other | the first failing worker's own status (1: an exception, its traceback above) |

When every failed worker agrees on a status the workers already said why, so nothing is added;
otherwise one line per failed rank names its host, local rank, pid and status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from lmforge.config.launch import LAUNCHER_ENV

STATUS_ENV = "LMFORGE_LAUNCH_STATUS_DIR"
PREEMPTED = 75  # (lmforge.train.preempt.PREEMPTED_EXIT_CODE, without importing torch here)

USAGE = "usage: lmforge launch [torchrun options] SUBCOMMAND [its arguments]   (e.g. --nproc-per-node 2 train ...)"


def split_argv(argv: list[str], subcommands: set[str]) -> tuple[list[str], list[str]]:
    """torchrun's options, then the lmforge sub-command with its arguments."""
    known = ", ".join(sorted(subcommands))
    if not argv:
        raise ValueError(f"no lmforge sub-command given (one of: {known})")
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (i == 0 or not argv[i - 1].startswith("-") or "=" in argv[i - 1]
                                        or argv[i - 1] in FLAGS):  # (a word that is no option's value)
            if arg in subcommands:
                return argv[:i], argv[i:]
            raise ValueError(f"unknown lmforge sub-command {arg!r} (one of: {known})")
    raise ValueError(f"no lmforge sub-command in {argv!r} (one of: {known})")


# torchrun options that take no value (so the word after one can be the sub-command)
FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
         "--tee-output", "--redirects"}


def exit_status(failures: dict[int, object]) -> tuple[int, list[str]]:
    """The launcher's exit status and the lines to print for torchrun's failures
    ({global rank: ProcessFailure}: local_rank, pid, exitcode; < 0 = killed by that signal)."""
    codes = {f.exitcode for f in failures.values()}
    first = min(failures, key=lambda r: (failures[r].timestamp, r))
    code = failures[first].exitcode
    status = 128 - code if code < 0 else (code if 0 < code < 256 else 1)
    if len(codes) == 1 and code > 0:
        return status, []  # every failing worker said the same (config error, 74, 75): its own line is above
    host = socket.gethostname()
    lines = []
    for rank in sorted(failures):
        f = failures[rank]
        how = (f"killed by {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 and -f.exitcode in
               signal.Signals._value2member_map_ else f"exited with status {f.exitcode}")
        lines.append(f"lmforge launch: rank {rank} (local rank {f.local_rank}, pid {f.pid}, host {host}) {how}"
                     + (" (first)" if rank == first and len(failures) > 1 else ""))
    return status, lines


def launch_main(argv: list[str], subcommands: set[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        argv, lighthouse_port = take_lighthouse_option(argv, subcommands)
        options, command = split_argv(argv, subcommands)
    except ValueError as exc:  # a usage error, not a run: exit 2 like any other (a bare `lmforge launch` too)
        print(f"lmforge launch: error: {exc}", file=sys.stderr)
        print(USAGE + "\n" + "\n".join(__doc__.splitlines()[2:4]) + "\n(lmforge launch --help: the rest)",
              file=sys.stderr)
        return 2
    os.environ[LAUNCHER_ENV] = "lmforge launch"  # (the workers' errors name this launcher)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from torch.distributed.elastic.multiprocessing.api import SignalException

    args = get_args_parser().parse_args([*options, "--module", "lmforge", *command])
    # the agent logs each failure itself ("failed (exitcode: 2) local_rank: 0 ..."): reported here instead
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        lighthouse = (lighthouse_running(lighthouse_binary(), lighthouse_port, min_replicas_option(command))
                      if lighthouse_port else None)
    except RuntimeError as exc:
        print(f"lmforge launch: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="lmforge-launch-") as statuses, lighthouse or contextlib.nullcontext():
        os.environ[STATUS_ENV] = statuses  # each worker writes its exit status there (lmforge/__main__.py)
        try:
            run(args)
        except ChildFailedError as exc:
            status, lines = exit_status(exc.failures)
            for line in lines:
                print(line, file=sys.stderr, flush=True)
            return status
        except SignalException as exc:  # a scheduler's signal to the launcher: the agent passed it on
            return signalled_status(exc.sigval, Path(statuses))
    return 0


LIGHTHOUSE_PORT = 29510  # (torchft's default)


def take_lighthouse_option(argv: list[str], subcommands: set[str]) -> tuple[list[str], int | None]:
    """`--lighthouse` / `--lighthouse=PORT` among the launcher's options (before the sub-command),
    removed: the argv left for torchrun, and the lighthouse's port (None: no lighthouse)."""
    end = next((i for i, arg in enumerate(argv) if arg in subcommands), len(argv))
    found = [arg for arg in argv[:end] if arg == "--lighthouse" or arg.startswith("--lighthouse=")]
    if not found:
        return argv, None
    value = found[-1].partition("=")[2] or str(LIGHTHOUSE_PORT)
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"--lighthouse={value}: give a port number (default {LIGHTHOUSE_PORT})")
    return [arg for arg in argv[:end] if arg not in found] + argv[end:], int(value)


def lighthouse_binary() -> str:
    """torchft's `torchft_lighthouse` (on PATH, or beside this interpreter)."""
    import shutil

    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(binary).is_file():
        raise RuntimeError("--lighthouse needs torchft's torchft_lighthouse: pip install \"lmforge[ft]\"")
    return binary


def min_replicas_option(command: list[str]) -> int:
    """fault_tolerance.min_replicas of the workers' `train` command, as the config loader reads it:
    its --config file or preset (or --run RUN_DIR's config.toml) with its overrides,
    `--fault_tolerance.min_replicas N` or `--fault-tolerance.min-replicas N` among them. 1 for another
    sub-command or a command whose config does not load (its workers then say why, once). (The
    command is split here, not by lmforge.cli's parser: lmforge.cli imports this module.)"""
    from lmforge.config import load_config, parse_cli_overrides
    from lmforge.folders import CONFIG

    if not command or command[0] != "train":
        return 1
    source, rest, args = "tiny", [], iter(command[1:])
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--config", "--run"):
            value = value if eq else next(args, "")
            source = value if name == "--config" else str(Path(value) / CONFIG)
        else:
            rest.append(arg)
    try:
        return max(1, load_config(source, parse_cli_overrides(rest), validate=False).fault_tolerance.min_replicas)
    except (ValueError, OSError):  # (ConfigError included)
        return 1


@contextlib.contextmanager
def lighthouse_running(binary: str, port: int, min_replicas: int = 1):
    """A torchft lighthouse on `port` while the workers run. A quorum needs `min_replicas` replica
    groups asking (the job's fault_tolerance.min_replicas, from the workers' config: with fewer,
    a group that reached a sync a few seconds after the others would be left out of it, and
    DiLoCo's groups would drift to syncing alone); it waits at most 5 s for a group that heartbeats
    but has not asked yet, and counts a group silent for 5 s as dead."""
    import subprocess

    proc = subprocess.Popen([binary, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
                             "--join_timeout_ms", "5000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://{socket.gethostname()}:{port}"
    os.environ["TORCHFT_LIGHTHOUSE"] = address
    print(f"lmforge launch: torchft lighthouse at {address} (fault_tolerance.lighthouse of the other groups)",
          file=sys.stderr, flush=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def signalled_status(sig: int, statuses: Path) -> int:
    """The launcher got `sig` and forwarded it to its workers, which checkpoint and exit 75 (the
    agent waits for them, torchrun's --shutdown-timeout, then kills the rest). 75 when every
    worker of this node said so; else 128 + the signal, with the workers' statuses."""
    codes = {p.name: p.read_text().strip() for p in statuses.iterdir()}
    if codes and set(codes.values()) == {str(PREEMPTED)}:
        return PREEMPTED
    name = signal.Signals(sig).name
    print(f"lmforge launch: {name} received; workers' exit statuses: "
          + (", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items())) or "none reported (killed)"),
          file=sys.stderr, flush=True)
    return 128 + int(sig)


def record_status(code: int) -> None:
    """In a worker started by `lmforge launch`: its exit status, for the launcher (a signal to the
    launcher ends with the agent's SignalException, which carries no worker statuses)."""
    folder = os.environ.get(STATUS_ENV)
    if folder and Path(folder).is_dir():
        (Path(folder) / os.environ.get("RANK", "0")).write_text(f"{code}\n")

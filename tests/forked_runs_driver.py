"""tests/train_runs_driver.py's runs on N ranks forked from one process, without torchrun.

    python tests/forked_runs_driver.py N RUNS

The parent imports torch and lmforge once, then forks its N ranks (RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set, as torchrun sets them), which run RUNS one after another in one process group.
torchrun starts each worker as a new interpreter that imports torch afresh: on the 2-core test
machine that import is most of a short run's cost (8 ranks: ~25 of ~45 CPU seconds). For the parity
and resharding tests, whose point is the process group and not the launcher; what torchrun itself
does (signals, restarts) is tested under torchrun. The exit status is the first failing rank's; a
failing rank ends the others (SIGKILL), as torchrun's agent does, rather than leaving them in a
collective until its timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys

import train_runs_driver  # (this script's folder is on sys.path; it imports lmforge and torch)
from lmforge.cli import exit_now

PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def main(nproc: int, runs: list[list[str]]) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush(), sys.stderr.flush()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:  # the rank: nothing of the parent's but its imports (no thread was started before the fork)
            code = 1
            try:
                with contextlib.suppress(OSError):  # die with the parent (a test's timeout kills the parent alone)
                    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                  LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                code = train_runs_driver.main(runs)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code if code > 0 else 128 - code
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    return failed


if __name__ == "__main__":
    exit_now(main(int(sys.argv[1]), json.loads(sys.argv[2])))

"""Preemption is a checkpoint: SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 stop a run at the end of
its current step with a checkpoint, instead of killing it.

What a scheduler does before it kills a job: Slurm sends the signal its `--signal` option names
(examples/slurm_train.sh asks for SIGUSR1 120 s ahead and hands it on as SIGTERM), Kubernetes
and cloud spot instances send SIGTERM, a user presses Ctrl-C (SIGINT). On the first one:

    the handler only records it (and rank 0 says so on stderr) -> the training loop asks
    `Preemption.requested()` once per step: every rank's flag, all-reduced (MAX) on the host gloo
    group, so all ranks stop after the same step even if only one was signalled -> the trainer
    saves a checkpoint synchronously on every rank, logs a `preempted` event, and the process
    exits with PREEMPTED_EXIT_CODE (75, sysexits' EX_TEMPFAIL: "try again later"); running the
    same command again resumes from that checkpoint, bit-identically.

A second signal exits at once (exit code 128 + the signal's number, as a kill would give) without
a checkpoint. Under torchrun one signal can arrive twice: the agent forwards the signal it got to
its workers, which may have had it already (Ctrl-C in a terminal reaches the whole process group,
Slurm can signal every process of a step). So under torchrun's agent the same signal within
DUPLICATE_WINDOW_S of the first counts once. The agent itself waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`
seconds (default 30) for its workers after forwarding, then kills them: a run whose checkpoint takes
longer must raise it (the Slurm example does).

Handlers are installed only from the main thread (Python allows no other) and the previous ones
are restored when the run ends, so a Trainer used inside another program leaves its signals alone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

PREEMPTED_EXIT_CODE = 75  # (sysexits.h EX_TEMPFAIL) the run stopped with a checkpoint; run it again to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
DUPLICATE_WINDOW_S = 1.0


class Preempted(Exception):
    """The run stopped for a signal after checkpointing `step` (raised out of `Trainer.fit`)."""

    def __init__(self, message: str, step: int, signal_name: str, checkpoint: str | None):
        super().__init__(message)
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


def _rank() -> str:
    return os.environ.get("RANK", "0")


class Preemption:
    """The signal handlers of one run, and the question the training loop asks once per step."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received (this rank)
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._under_agent = "TORCHELASTIC_RUN_ID" in os.environ
        self.group = None  # the host (gloo) group of a distributed run, set once it exists
        self.distributed = False

    # -- handlers ---------------------------------------------------------------------------------

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            if _rank() == "0":
                _say(f"lmforge: {name} received: stopping after this step with a checkpoint "
                     f"(a second signal stops at once, without one)")
            return
        if self._under_agent and signum == self.signum and time.monotonic() - self._first_at < DUPLICATE_WINDOW_S:
            return  # torchrun's agent forwarding the signal this worker already had
        if _rank() == "0":
            _say(f"lmforge: second signal ({name}): stopping now, without a checkpoint")
        os._exit(128 + signum)

    # -- the question the loop asks ---------------------------------------------------------------

    def attach(self, group, distributed: bool) -> None:
        """The group on which the ranks agree (every rank, once the process group exists)."""
        self.group, self.distributed = group, distributed

    def requested(self) -> bool:
        """Stop now? The same answer on every rank: one all-reduce (MAX) of each rank's flag on the
        host group, so every rank of a distributed run must call this at the same point of a step."""
        seen = self.signum is not None
        if not self.distributed:
            return seen
        import torch  # (here: `lmforge sweep` reads PREEMPTED_EXIT_CODE without loading torch)

        flag = torch.tensor([int(seen)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    @property
    def signal_name(self) -> str:
        """The signal this rank received, or (a rank stopped for a peer's) `a peer's signal`."""
        return signal.Signals(self.signum).name if self.signum is not None else "a peer's signal"


def _say(line: str) -> None:
    """One line to stderr from a signal handler (os.write: print could re-enter a print it interrupted)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass

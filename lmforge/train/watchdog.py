"""A stuck rank is named, never silent: a watchdog thread on every rank notices a training step that
has not finished within `train.hang_factor` x the recent median step time (at least
`train.hang_min_s`; both well under the collective timeout `parallel.timeout_s`), and writes every
thread's Python stack (faulthandler) to `<run>/hang/<rank>.txt`, on CUDA also torch's NCCL flight
recorder where it is enabled (`TORCH_NCCL_TRACE_BUFFER_SIZE` > 0): `<run>/hang/<rank>.nccl.pkl`.
Rank 0 logs a `hang` event. Then, per `train.hang_action`, the rank exits with `EXIT_HANG` (76,
`EXIT_GRACE_S` later, so that the other stuck ranks write theirs first; the launcher ends them,
and a scheduler restarts the job from its last checkpoint) or keeps waiting (the files are written once per stuck step).

Every rank stuck in the same step writes its own file: the rank that is stuck somewhere of its own
(a dead loader, a deadlock) shows where; the others show the collective they wait in. The same
files are written when a collective times out (`dump`, called by the trainer).

The watchdog only watches training steps: it is armed from the start of a step to its end, after
`WARMUP_STEPS` steps (the first steps compile and allocate), so validation, checkpoints and the
final save never count as a hang. Why hand-written: torch's own watchdogs are per backend (the NCCL
watchdog aborts a timed-out collective; gloo has none) and dump no Python stacks of a rank stuck
outside a collective."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

EXIT_HANG = 76  # a rank's step stopped making progress (stacks in <run>/hang/); the job can be restarted
# Before exiting, a rank whose watchdog fired waits this long: the other ranks stuck in the same step
# fire within it (the same limit, from nearly the same start) and write their stacks before the
# launcher, seeing this rank's exit, ends them. (Without it a busy machine lost the later rank's file.)
EXIT_GRACE_S = 5.0
WARMUP_STEPS = 3
HANG_DIR = "hang"


class HangWatchdog:
    def __init__(self, run_dir: Path, rank: int, factor: float, min_s: float, action: str,
                 on_hang: Callable[[dict], None] | None = None, poll_s: float = 0.2):
        self.dir = Path(run_dir) / HANG_DIR
        self.rank, self.factor, self.min_s, self.action = rank, factor, min_s, action
        self.on_hang = on_hang
        self.poll_s = poll_s
        self.recent: deque[float] = deque(maxlen=50)
        self.step: int | None = None  # the step being watched (armed), else None
        self.started = 0.0
        self.fired_for: int | None = None
        self._begun: float | None = None
        self._paused_s = 0.0
        self._current: int | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def start(self) -> "HangWatchdog":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="lmforge-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def limit(self) -> float:
        """Seconds a step may take before it counts as a hang."""
        return max(self.min_s, self.factor * statistics.median(self.recent)) if self.recent else self.min_s

    def step_begin(self, step: int) -> None:
        """A training step starts (armed once WARMUP_STEPS steps have been timed)."""
        with self._lock:
            self._begun, self._paused_s, self._current = time.monotonic(), 0.0, step
            if len(self.recent) >= WARMUP_STEPS:
                self.step, self.started = step, self._begun

    def step_end(self) -> None:
        """The step is done: disarmed; its time (pauses excluded) joins the recent median."""
        with self._lock:
            self.step = None
            if self._begun is not None:
                self.recent.append(time.monotonic() - self._begun - self._paused_s)
            self._begun = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Around work inside a step that is not the step's training (validation, a checkpoint, a
        rollback): not watched, not counted in the step's time."""
        with self._lock:
            armed, self.step = self.step, None
        t0 = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._paused_s += time.monotonic() - t0
                if armed is not None:
                    self.step, self.started = armed, time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                step, waited, limit = self.step, time.monotonic() - self.started, self.limit()
            if step is None or waited < limit or self.fired_for == step:
                continue
            self.fired_for = step
            reason = (f"step {step} has not finished after {waited:.1f} s (limit {limit:.1f} s: train.hang_factor "
                      f"{self.factor:g} x the recent median step, at least train.hang_min_s {self.min_s:g})")
            path = self.dump(reason)
            if self.on_hang is not None:
                try:
                    self.on_hang({"event": "hang", "step": step, "rank": self.rank, "waited_s": waited,
                                  "limit_s": limit, "stacks": str(path), "action": self.action,
                                  "message": f"hang: rank {self.rank}: {reason}; every thread's stack in {path}"
                                             + (f"; exiting with code {EXIT_HANG}" if self.action == "exit" else "")})
                except Exception:  # noqa: BLE001 - the dump is written; the event is best effort
                    pass
            if self.action == "exit":
                print(f"lmforge: rank {self.rank}: {reason}; stacks in {path}; exiting with code {EXIT_HANG} "
                      f"in {EXIT_GRACE_S:g} s", file=sys.stderr, flush=True)
                time.sleep(EXIT_GRACE_S)
                os._exit(EXIT_HANG)  # (the main thread is stuck: nothing else can end the process)

    def dump(self, reason: str) -> Path:
        """Every thread's Python stack (and the NCCL flight recorder where enabled) into
        hang/<rank>.txt; returns its path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{self.rank}.txt"
        with open(path, "w") as fh:
            fh.write(f"rank {self.rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}\n\n")
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        nccl_trace(self.dir / f"{self.rank}.nccl.pkl")
        return path


def nccl_trace(path: Path) -> bool:
    """torch's NCCL flight-recorder dump (CUDA runs with TORCH_NCCL_TRACE_BUFFER_SIZE > 0) into
    `path`; False where there is none."""
    if int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or 0) <= 0:
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)  # (torch's flight recorder)
        if dump is None:
            return False
        data = dump()  # (pickled; torch's fr_trace tool reads it)
    except (RuntimeError, ImportError):
        return False
    path.write_bytes(data)
    return True

"""What the loop records of its steps: the pending steps of the log window (read from the device
only when a log line is due: one host sync per window), the throughput window (tokens/s, MFU, time
shares), the phase clock of the straggler report, the health signals, the history and the live
progress, and the run's training seconds across resumes."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from lmforge.train.metrics import HealthMonitor, ThroughputWindow, Timers
from lmforge.train.progress import Progress
from lmforge.train.stragglers import PhaseClock


@dataclass(frozen=True)
class StepTokens:
    """The tokens one optimizer step trains: over the whole job (`trained`: what tokens_seen counts)
    and on this process's ranks (`here`: what tokens/s and MFU count). The same number, but for a
    replica group of a fault-tolerant job (lmforge.train.fault_tolerance: its quorum's shares)."""

    trained: int
    here: int


@dataclass(frozen=True)
class StepEvents:
    """What the loop does after step `step` by count (computed once per step, read by the loop and
    by the guard): a log line, an evaluation, a checkpoint by step count, the last step. At each of
    them the loop syncs with the device anyway."""

    log: bool
    evaluate: bool
    checkpoint_by_count: bool
    last: bool

    @classmethod
    def at(cls, cfg, step: int) -> "StepEvents":
        t, c = cfg.train, cfg.checkpoint
        return cls(log=step % t.log_every == 0 or step >= t.steps,
                   evaluate=bool(t.eval_every and step % t.eval_every == 0 and step < t.steps),
                   checkpoint_by_count=bool(c.every_steps and step % c.every_steps == 0),
                   last=step >= t.steps)

    @property
    def syncs(self) -> bool:
        """The loop reads device values at this step anyway: the guard books its verdict here, so
        events, rollbacks and the saved guard state are those of the host check at the same step."""
        return self.log or self.evaluate or self.checkpoint_by_count or self.last


class StepLog:
    def __init__(self, cfg, device: torch.device):
        t = cfg.train
        self.cfg, self.device = cfg, device
        self.health = HealthMonitor(t.spike_threshold, t.health_window, t.grad_growth_factor)
        self.timers = Timers()  # `with timers("checkpoint"):` around blocking saves -> ckpt_s
        self.phases = PhaseClock(device)  # each step's phases (lmforge.train.stragglers)
        self.step_t0: float | None = None  # when the loop's current step began (its data phase)
        self.step_tokens: StepTokens | None = None  # what the loop's current step trains (a handler may say)
        self.pending: list[tuple] = []  # steps since the last log line: read (host sync) only when logging
        self.history: list[dict] = []
        self.progress: Progress | None = None
        self.window: ThroughputWindow | None = None
        self.clock: tuple[float, float] | None = None  # (seconds of the legs before this one, this leg's t0)
        self.live = False  # the loop's progress is shown: lines go under it

    def start(self, state) -> None:
        """The loop starts (or continues at `state.step`): the live progress."""
        self.progress = Progress(self.cfg.train.steps, self.cfg.train.progress, initial=state.step)
        self.live = True

    def start_window(self, state, flops_per_token: float, peak) -> None:
        """The first step is next: the throughput window and this leg's clock start now."""
        self.window = ThroughputWindow(flops_per_token, peak, self.cfg.parallel.world_size, self.device, self.timers)
        self.clock = (state.seconds, self.window.start)

    def run_seconds(self, state) -> float:
        """Training seconds of the whole run so far: the legs before this one (up to the checkpoint it
        resumed: `state.seconds` until this leg starts) and this one's since its first step."""
        if self.clock is None:
            return state.seconds
        before, t0 = self.clock
        return before + time.perf_counter() - t0

    def add(self, step: int, loss, grad_norm, lr: float, tokens: int, step_tokens: int, data_s: float,
            moe: dict) -> None:
        self.window.add_step(step_tokens, data_s)
        self.pending.append((step, loss, grad_norm, lr, tokens, data_s, moe))

    def timed_eval(self):
        """A context: the time inside counts as evaluation in the window (not training)."""
        return _Timed(self.window)

    def write(self, trainer, extra, steps_done: int) -> None:
        """Metrics records of the steps since the last log line (one host sync for all of them), with
        the window's statistics and `extra()`'s fields (the handlers' `log_window`, called once the
        window is timed: they may wait in a collective); the progress line."""
        if self.device.type == "cuda":  # the log line's one sync, before timing the window
            torch.cuda.synchronize(self.device)
        stats = self.window.take()
        stats = {**stats, **extra()}
        self.flush(trainer, stats)
        st, t = trainer.state, self.cfg.train
        eta = (t.steps - st.step) * (time.perf_counter() - self.window.start) / max(steps_done, 1)
        self.progress.update(st.step, self.history[-1], eta)

    def flush(self, trainer, stats: dict) -> None:
        metrics, layout = trainer.metrics, trainer.layout
        for step, loss, grad_norm, lr, tokens, data_s, moe in self.pending:
            rec = {"step": step, "loss": float(loss), "grad_norm": float(grad_norm), "lr": lr, "tokens": tokens,
                   **stats, "data_s": data_s, **layout.moe_metrics(moe)}
            self.history.append(rec)
            metrics.write(rec)
            for event in self.health.update(step, rec["loss"], rec["grad_norm"]):
                metrics.write(event)
                self.progress.write(f"warning: {event['message']}", logging.WARNING)
        self.pending.clear()
        metrics.flush()
        st = trainer.state
        st.last_loss = self.history[-1]["loss"]
        if not math.isfinite(st.last_loss) and trainer.guard is None:
            self.close()
            raise FloatingPointError(f"loss became {st.last_loss} at step {st.step}; lower optim.lr, "
                                     f"use precision = 'bf16', or enable the guard (guard.enabled).")

    def say(self, line: str) -> None:
        """A line under the progress bar while the loop runs, else into the log."""
        if self.live:
            self.progress.write(line)
        else:
            logging.getLogger("lmforge.train").info("%s", line)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.live = False


class _Timed:
    def __init__(self, window: ThroughputWindow):
        self.window = window

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.window.add_eval(time.perf_counter() - self.t0)

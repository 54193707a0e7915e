"""Rank health as a handler of the loop's events (lmforge.train.events): the straggler report
(lmforge.train.stragglers: each log window's slowest and fastest rank, a rank slow for long enough
named as a `straggler` event) and the hang watchdog (lmforge.train.watchdog: a step that takes far
longer than usual dumps every thread's stack, and a collective that timed out does too)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from lmforge.train.events import Handler
from lmforge.train.stragglers import StragglerMonitor
from lmforge.train.watchdog import HangWatchdog


class RankHealth(Handler):
    def __init__(self) -> None:
        self.stragglers: StragglerMonitor | None = None
        self.watchdog: HangWatchdog | None = None

    def run_start(self, trainer) -> None:
        """Every rank: the comparison's host names are gathered here (a collective); the watchdog's
        thread starts."""
        t, d = trainer.cfg.train, trainer.dist
        self.stragglers = StragglerMonitor(t.straggler_ratio, t.straggler_windows, d.host_group, d.distributed)
        self.watchdog = HangWatchdog(trainer.out_dir, d.rank, t.hang_factor, t.hang_min_s, t.hang_action,
                                     on_hang=trainer.log_event).start()

    def step_begin(self, trainer, step: int) -> None:
        self.watchdog.step_begin(step)

    def log_window(self, trainer) -> dict:
        """This window's slowest and fastest rank (a collective on the host group: every rank logs at
        the same steps)."""
        fields, events = self.stragglers.window(trainer.steplog.phases.take())
        for event in events:
            trainer.log_event(event)
        return fields

    @contextlib.contextmanager
    def paused(self, trainer) -> Iterator[None]:
        with self.watchdog.paused():
            yield

    def step_end(self, trainer, step: int) -> None:
        self.watchdog.step_end()

    def close(self, trainer, error: BaseException | None) -> None:
        if self.watchdog is None:
            return
        if isinstance(error, RuntimeError) and "timed out" in str(error).lower():  # every thread's stack, as for a hang
            self.watchdog.dump(f"a collective timed out (parallel.timeout_s = {trainer.cfg.parallel.timeout_s:g}): "
                               f"{error}")
        self.watchdog.stop()

"""`lmforge train` with one rank stalled (for test_parallel_dp.py's collective-timeout test).

    torchrun --nproc-per-node N tests/stall_driver.py RANK STEP SECONDS MARKER [train overrides ...]

Runs the real `lmforge train` command line, except that rank RANK sleeps SECONDS at the start of
its optimizer step STEP (1-based: the `step_begin` event, lmforge.train.events), after writing the
time it fell asleep to MARKER: the other ranks then wait in that step's first collective, which must
fail after parallel.timeout_s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lmforge.cli import exit_now, main
from lmforge.train.events import Handler, register_handler


class Stall(Handler):
    def __init__(self, rank: int, step: int, seconds: float, marker: Path):
        self.rank, self.step, self.seconds, self.marker = rank, step, seconds, marker

    def step_begin(self, trainer, step: int) -> None:
        if trainer.dist.rank == self.rank and step == self.step:
            self.stalled()

    def stalled(self) -> None:  # (the name test_rank_health looks for in the hang's stack dump)
        self.marker.write_text(f"{time.time()}\n")
        time.sleep(self.seconds)


if __name__ == "__main__":
    rank, step, seconds, marker, *overrides = sys.argv[1:]
    register_handler(lambda: Stall(int(rank), int(step), float(seconds), Path(marker)))
    exit_now(main(["train", *overrides]))

"""`lmforge train` with one rank slowed (for tests/test_rank_health.py's straggler test).

    torchrun --nproc-per-node N tests/slow_rank_driver.py RANK SECONDS [train overrides ...]

Runs the real `lmforge train` command line, except that rank RANK sleeps SECONDS at the start of
every optimizer step (the `step_begin` event, lmforge.train.events: in the step's data phase, as a
slow loader or a busy host would), RANK -1: no rank.
"""

from __future__ import annotations

import sys
import time

from lmforge.cli import main
from lmforge.train.events import Handler, register_handler


class Slow(Handler):
    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def step_begin(self, trainer, step: int) -> None:
        if trainer.dist.rank == self.rank:
            time.sleep(self.seconds)


if __name__ == "__main__":
    rank, seconds, *overrides = sys.argv[1:]
    register_handler(lambda: Slow(int(rank), float(seconds)))
    sys.exit(main(["train", *overrides]))

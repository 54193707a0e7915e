"""`lmforge train` runs with one rank slowed (for tests/test_rank_health.py's straggler test).

    torchrun --nproc-per-node N tests/slow_rank_driver.py RUNS

RUNS is a JSON list of [RANK, SECONDS, [train overrides ...]]: the runs go one after another through
the real `lmforge train` command line in one process group (tests/train_runs_driver.py), and in each
rank RANK sleeps SECONDS at the start of every optimizer step (the `step_begin` event,
lmforge.train.events: in the step's data phase, as a slow loader or a busy host would); RANK -1: no
rank.
"""

from __future__ import annotations

import json
import sys
import time

from lmforge.train.events import Handler, register_handler
from train_runs_driver import main as train_runs  # (this script's folder is on sys.path)
from lmforge.cli import exit_now


class Slow(Handler):
    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def step_begin(self, trainer, step: int) -> None:
        if trainer.dist.rank == self.rank:
            time.sleep(self.seconds)


if __name__ == "__main__":
    runs = json.loads(sys.argv[1])
    slowed = iter([(int(rank), float(seconds)) for rank, seconds, _ in runs])
    register_handler(lambda: Slow(*next(slowed)))  # (one trainer per run, built in order)
    exit_now(train_runs([overrides for _, _, overrides in runs]))

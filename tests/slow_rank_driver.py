"""`lmforge train` with one rank slowed (for tests/test_rank_health.py's straggler test).

    torchrun --nproc-per-node N tests/slow_rank_driver.py RANK SECONDS [train overrides ...]

Runs the real `lmforge train` command line, except that rank RANK sleeps SECONDS at the start of
every optimizer step's compute (as a slow loader or a busy host would), RANK -1: no rank.
"""

from __future__ import annotations

import sys
import time

import lmforge.train.trainer as trainer_module
from lmforge.cli import main


def slow(rank: int, seconds: float) -> None:
    train_step = trainer_module.Trainer.train_step

    def slowed(self, micro_batches):
        if self.dist.rank == rank:
            time.sleep(seconds)
        return train_step(self, micro_batches)

    trainer_module.Trainer.train_step = slowed


if __name__ == "__main__":
    rank, seconds, *overrides = sys.argv[1:]
    slow(int(rank), float(seconds))
    sys.exit(main(["train", *overrides]))

"""`lmforge train` with one rank stalled (for test_parallel_dp.py's collective-timeout test).

    torchrun --nproc-per-node N tests/stall_driver.py RANK STEP SECONDS MARKER [train overrides ...]

Runs the real `lmforge train` command line, except that rank RANK sleeps SECONDS before its
optimizer step STEP (1-based), after writing the time it fell asleep to MARKER: the other ranks
then wait in that step's first collective, which must fail after parallel.timeout_s.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import lmforge.train.trainer as trainer_module
from lmforge.cli import main


def stall(rank: int, step: int, seconds: float, marker: Path) -> None:
    train_step = trainer_module.Trainer.train_step

    def stalled(self, micro_batches):
        if self.dist.rank == rank and self.state.step + 1 == step:
            marker.write_text(f"{time.time()}\n")
            time.sleep(seconds)
        return train_step(self, micro_batches)

    trainer_module.Trainer.train_step = stalled


if __name__ == "__main__":
    rank, step, seconds, marker, *overrides = sys.argv[1:]
    stall(int(rank), int(step), float(seconds), Path(marker))
    sys.exit(main(["train", *overrides]))

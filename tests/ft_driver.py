"""`lmforge train` whose steps can be paced and held (for tests/test_ft.py's fault-tolerance test).

    python tests/ft_driver.py SECONDS HOLD_FILE [train overrides ...]

Runs the real `lmforge train` command line, except that every optimizer step waits SECONDS at its
start (the `step_begin` event, after the fault-tolerance handler formed the step's quorum: time for
the test to kill a group mid-run), and waits longer while HOLD_FILE exists (at most 120 s): the test
holds the survivor there until the restarted group is up, so the survivor cannot finish the run
before the other rejoins however slowly this machine starts a process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from lmforge.cli import exit_now, main
from lmforge.train.events import Handler, register_handler


class Paced(Handler):
    def __init__(self, seconds: float, hold: Path):
        self.seconds, self.hold = seconds, hold

    def step_begin(self, trainer, step: int) -> None:
        time.sleep(self.seconds)
        deadline = time.time() + 120
        while self.hold.exists() and time.time() < deadline:
            time.sleep(0.02)


if __name__ == "__main__":
    seconds, hold, *overrides = sys.argv[1:]
    register_handler(lambda: Paced(float(seconds), Path(hold)))
    exit_now(main(["train", *overrides]))

"""Several `lmforge train` runs one after another in one process group (for the parity tests).

    [torchrun --nproc-per-node N] tests/train_runs_driver.py RUNS

RUNS is a JSON list of argument lists, each the `--section.key value ...` of one `lmforge train`
command line. Each goes through the real command line (`lmforge.cli.main`), as `python -m lmforge
train` would; the process group that the first run forms is kept for the others. One launch for
several runs keeps the tests fast: torch's import and the process-group setup are paid once, not
once per run.
"""

from __future__ import annotations

import json
import os
import sys

import lmforge.train.trainer as trainer_module
from lmforge.cli import exit_now
from lmforge.cli import main as lmforge_main
from lmforge.parallel.mesh import destroy_distributed

RUN_MARKER = "train_runs_driver: run"


def main(runs: list[list[str]]) -> int:
    trainer_module.destroy_distributed = lambda: None  # keep one process group for every run
    try:
        for i, args in enumerate(runs):
            # where each run's lines begin (tests/test_parallel_dp.py's `run_logs` cuts the output there)
            if os.environ.get("RANK", "0") == "0":
                for stream in (sys.stdout, sys.stderr):
                    print(f"{RUN_MARKER} {i}", file=stream, flush=True)
            if code := lmforge_main(["train", *args]):
                return code
        return 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    exit_now(main(json.loads(sys.argv[1])))

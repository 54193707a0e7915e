"""Train several optimizers one after another in one process group (for test_parallel_optim.py).

    [torchrun --nproc-per-node N] tests/optim_layout_driver.py CORPUS OUT OPTIMIZERS [key=value ...]

For each comma-separated optimizer name, a real `Trainer(cfg).fit()` writes OUT/<name>/ (metrics,
checkpoints) under the layout given by the key=value overrides. One launch for all of them keeps
the test fast: torch's import and the process-group setup are paid once, not once per optimizer.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import lmforge.train.trainer as trainer_module
from lmforge.config import load_config, parse_cli_overrides
from lmforge.parallel.mesh import destroy_distributed


def main() -> None:
    corpus, out, names, *pairs = sys.argv[1:]
    overrides = dict(pair.split("=", 1) for pair in pairs)
    trainer_module.destroy_distributed = lambda: None  # keep one process group for every run
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    try:
        for name in names.split(","):
            args = {**overrides, "optim.name": name, "data.corpus": corpus, "train.out_dir": str(Path(out) / name)}
            cfg = load_config("tiny", parse_cli_overrides([a for k, v in args.items() for a in (f"--{k}", v)]))
            trainer_module.Trainer(cfg).fit()
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()

"""One process of a `lmforge plan --verify` run: trains the runs of a job file with the real `Trainer`
and records, per rank, the bytes of the model states it holds.

    [python -m torch.distributed.run --nproc-per-node W] -m lmforge.verify.rank JOB.json

JOB.json: {"runs": [{"config": CONFIG.toml, "out": RUN_DIR, "resume": CHECKPOINT or null, "perturb": SEED or
null, "probe": STEP or null}, ...]} ("perturb": the run's 16-bit rounding perturbed, lmforge/verify/perturb.py: a
band's rerun; "probe": per-module norms at optimizer step STEP, lmforge/verify/probe.py, written per rank
to RUN_DIR/probe.rank<r>.json). TEST-ONLY: LMFORGE_VERIFY_FAULT names a fault of lmforge/verify/faults.py
that the multi-process runs get. Each run
writes its run folder as `lmforge train` does (metrics.jsonl: every step's loss and gradient norm) and
RUN_DIR/memory.rank<r>.json: the bytes of this rank's parameters (local shards, each tensor once),
of its gradients at their largest (before the optimizer step zeroes them), of its optimizer state
(after the step) and of its EMA of the weights (if any), with the rank's pipeline stage: what `lmforge plan` estimates per GPU as weights,
gradients and optimizer states.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from lmforge.config import load_config
from lmforge.train.events import Handler
from lmforge.train.trainer import Trainer
from lmforge.verify import faults
from lmforge.verify.perturb import rounding_perturbed
from lmforge.verify.probe import PROBE_FILE, Probe

MEMORY_FILE = "memory.rank{rank}.json"


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2, TP): this rank's shard
    return local.numel() * local.element_size()


class MemoryMeasure(Handler):
    """A handler of the trainer's events (lmforge.train.events): the largest bytes of gradients (once
    the backward has accumulated them) and of optimizer state (after the update) this rank holds."""

    def __init__(self) -> None:
        self.measured = {"gradients": 0, "optimizer_states": 0}
        self.grads = 0

    @staticmethod
    def _params(trainer) -> list[torch.Tensor]:
        return list({id(p): p for g in trainer.optimizer.param_groups for p in g["params"]}.values())

    def backward_end(self, trainer, loss) -> None:
        self.grads = sum(_local_bytes(p.grad) for p in self._params(trainer) if p.grad is not None)

    def update_end(self, trainer, step: int) -> None:
        inner = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer: the local shard's
        states = sum(_local_bytes(v) for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        seen = self.measured
        self.measured = {"weights": sum(_local_bytes(p) for p in self._params(trainer)),
                         "gradients": max(seen["gradients"], self.grads),
                         "optimizer_states": max(seen["optimizer_states"], states),
                         "ema": trainer.ema.local_bytes() if trainer.ema is not None else 0}


def run(job: dict) -> int:
    for spec in job["runs"]:
        overrides = {"train.out_dir": spec["out"]}
        if spec.get("resume"):
            overrides["checkpoint.resume"] = spec["resume"]
        cfg = load_config(spec["config"], overrides)
        measure = MemoryMeasure()
        trainer = Trainer(cfg, out_dir=spec["out"], handlers=[measure])
        with contextlib.ExitStack() as stack:
            if spec.get("perturb"):
                stack.enter_context(rounding_perturbed(spec["perturb"], cfg.train.precision))
            probe = stack.enter_context(Probe(spec["probe"])) if spec.get("probe") else None
            stack.enter_context(faults.installed(os.environ.get(faults.FAULT_ENV)))
            trainer.fit()
        if probe is not None:
            d = trainer.dist
            probe.write(Path(spec["out"]) / PROBE_FILE.format(rank=d.rank),
                        {"rank": d.rank, "dp": d.dp_rank, "cp": d.cp_rank, "tp": d.tp_rank, "pp": d.pp_rank})
        measured = measure.measured if "weights" in measure.measured else {}  # (no step ran: nothing measured)
        record = {"rank": trainer.dist.rank, "pp_rank": trainer.dist.pp_rank, **measured}
        path = Path(spec["out"]) / MEMORY_FILE.format(rank=trainer.dist.rank)
        path.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))

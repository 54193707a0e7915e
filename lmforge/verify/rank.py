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
from lmforge.train.trainer import Trainer
from lmforge.verify import faults
from lmforge.verify.perturb import rounding_perturbed
from lmforge.verify.probe import PROBE_FILE, Probe

MEMORY_FILE = "memory.rank{rank}.json"


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor (FSDP2, TP): this rank's shard
    return local.numel() * local.element_size()


class MeasuringTrainer(Trainer):
    """The trainer, recording the largest bytes of gradients and optimizer state this rank holds."""

    measured: dict[str, int]

    def _params(self) -> list[torch.Tensor]:
        return list({id(p): p for g in self.optimizer.param_groups for p in g["params"]}.values())

    def update(self, loss: torch.Tensor) -> torch.Tensor:
        grads = sum(_local_bytes(p.grad) for p in self._params() if p.grad is not None)
        grad_norm = super().update(loss)
        inner = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: the local shard's
        states = sum(_local_bytes(v) for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        seen = getattr(self, "measured", {"gradients": 0, "optimizer_states": 0})
        self.measured = {"weights": sum(_local_bytes(p) for p in self._params()),
                         "gradients": max(seen["gradients"], grads),
                         "optimizer_states": max(seen["optimizer_states"], states),
                         "ema": self.ema.local_bytes() if self.ema is not None else 0}
        return grad_norm


def run(job: dict) -> int:
    for spec in job["runs"]:
        overrides = {"train.out_dir": spec["out"]}
        if spec.get("resume"):
            overrides["checkpoint.resume"] = spec["resume"]
        cfg = load_config(spec["config"], overrides)
        trainer = MeasuringTrainer(cfg, out_dir=spec["out"])
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
        record = {"rank": trainer.dist.rank, "pp_rank": trainer.dist.pp_rank, **getattr(trainer, "measured", {})}
        path = Path(spec["out"]) / MEMORY_FILE.format(rank=trainer.dist.rank)
        path.write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))

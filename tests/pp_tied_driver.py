"""tests/train_runs_driver.py's runs, and after each one the check that a pipeline's two copies of a
tied embedding (the first stage's embedding, the last stage's head) are bit-equal, weights and
AdamW moments (tests/test_parallel_pp_tied.py).

    torchrun --nproc-per-node N tests/pp_tied_driver.py RUNS

Prints "tied copies bit-equal after S steps (SCHEDULE)" once per run on the first stage's rank 0
and exits non-zero when they differ or a run kept no copy on the last stage.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import lmforge.parallel.pipeline as pipeline
import lmforge.train.trainer as trainer_module
from lmforge.cli import exit_now
from lmforge.cli import main as lmforge_main
from lmforge.parallel.mesh import destroy_distributed


def copies_equal(layout: pipeline.Pipelined, optimizer_state: dict) -> bool:
    """Whether this rank's copy (its local shard) equals its embedding-group peer's, bit for bit."""
    weight = layout.model.tok_emb.weight
    local = [weight.detach()] + [optimizer_state.get(k) for k in ("exp_avg", "exp_avg_sq")]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in local if t is not None]
    mine = torch.cat([t.reshape(-1) for t in local])
    other = mine.clone()
    dist.broadcast(other, src=dist.get_global_rank(layout.embedding_group, 0), group=layout.embedding_group)
    return torch.equal(mine, other)


def main(runs: list[list[str]]) -> int:
    trainer_module.destroy_distributed = lambda: None  # keep one process group for every run
    layouts: list = []
    optimizers: list = []
    init, prepare = pipeline.Pipelined.__init__, pipeline.Pipelined.prepare_optimizer

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        layouts.append(self)

    def record_optimizer(self, optimizer):
        optimizers.append(prepare(self, optimizer))
        return optimizers[-1]

    pipeline.Pipelined.__init__, pipeline.Pipelined.prepare_optimizer = record, record_optimizer
    try:
        for args in runs:
            if code := lmforge_main(["train", *args]):
                return code
            layout, optimizer = layouts[-1], optimizers[-1]
            if layout.embedding_group is None:  # (a V: one parameter on rank 0, nothing to compare)
                continue
            if layout.first or layout.last:
                state = optimizer.state.get(layout.model.tok_emb.weight, {})
                same = torch.tensor(int(copies_equal(layout, state)))
                dist.all_reduce(same, op=dist.ReduceOp.MIN, group=layout.embedding_group)
                steps = int(state["step"]) if "step" in state else -1
                if not same.item():
                    print(f"tied copies differ after {steps} steps ({layout.cfg.parallel.pp_schedule})", flush=True)
                    return 3
                if layout.first and dist.get_rank() == 0:
                    print(f"tied copies bit-equal after {steps} steps ({layout.cfg.parallel.pp_schedule})", flush=True)
        return 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    exit_now(main(json.loads(sys.argv[1])))

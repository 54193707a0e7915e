"""Context-parallel runs and probes in one process group (for tests/test_parallel_cp.py).

    [torchrun --nproc-per-node N] tests/cp_driver.py SPEC.json

SPEC: {"out": folder, "runs": [{"name": ..., "overrides": {key: value}}, ...], "probe": {...} or
absent}. Each run is a real `Trainer(cfg).fit()` (the "tiny" preset + its overrides) writing
OUT/<name>/, one after another in the same process group (torch's import and the process-group
setup are paid once per launch). The probe (4 ranks) measures, on every rank, what the CP hook does
at cp = 1, 2 and 4 (its "cp_mode": "allgather", the default, or "ulysses") against one process:
attention outputs and gradients, the bytes autograd saves and the bytes through the collectives, and
writes OUT/probe_rank<r>.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lmforge.train.trainer as trainer_module
from lmforge.config import load_config, parse_cli_overrides
from lmforge.parallel.mesh import destroy_distributed


def run_trainings(spec: dict) -> None:
    if dist.is_initialized():
        trainer_module.destroy_distributed = lambda: None  # keep one process group for every run
    for run in spec["runs"]:
        args = {**run["overrides"], "train.out_dir": str(Path(spec["out"]) / run["name"])}
        cfg = load_config("tiny", parse_cli_overrides([a for k, v in args.items() for a in (f"--{k}", str(v))]))
        trainer = trainer_module.Trainer(cfg)
        t0 = time.perf_counter()
        trainer.fit()
        if trainer.dist.rank == 0:
            print(f"TIMING {run['name']} {time.perf_counter() - t0:.1f} s", flush=True)
        if trainer.dist.rank == 0 and trainer.layout.cp is not None:  # bytes through the CP collectives
            comm = {**trainer.layout.cp.comm, "steps": trainer.state.step}
            (Path(spec["out"]) / run["name"] / "cp_comm.json").write_text(json.dumps(comm))


def probe(spec: dict) -> None:
    """cp = 1 (every rank alone), 2 (ranks {0,1}, {2,3}) and 4 on the same model and batch."""
    from lmforge.config import ModelConfig
    from lmforge.model.loss import token_nll_sum
    from lmforge.model.transformer import build_model
    from lmforge.parallel.activation_ckpt import saved_activation_bytes
    from lmforge.parallel.context_parallel import sequence_sharding

    p = spec["probe"]
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank creates every group)
    model = build_model(ModelConfig(**p["model"]), seed=0)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    b, t = p["batch"], p["seq_len"]
    tokens = torch.randint(0, model.cfg.vocab_size, (b, t + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out: dict = {}
    for cp in (1, 2, 4):
        group = None if cp == world else (pairs[rank // 2] if cp == 2 else None)
        sharding = None if cp == 1 else sequence_sharding(p.get("cp_mode", "allgather"), group, rank % cp, cp,
                                                          torch.device("cpu"))
        xs, ys = (x, y) if sharding is None else (sharding.local(x), sharding.local(y))

        def loss():  # (the trainer's default loss: logits, then the summed token NLL)
            if sharding is None:
                return token_nll_sum(model(xs), ys)
            with sharding.sharded(t):
                return token_nll_sum(model(xs), ys)

        saved = saved_activation_bytes(loss, exclude=params)
        model.zero_grad()
        if sharding is None:
            nll = loss()
            nll.backward()
        else:
            with sharding.sharded(t):
                nll = token_nll_sum(model(xs), ys)
                before = dict(sharding.comm)
                nll.backward()
        grads = torch.cat([q.grad.flatten() for q in params])
        nll = nll.detach().clone()
        if sharding is not None:  # the parameter gradient and the loss are sums over the CP ranks
            dist.all_reduce(grads, group=group)
            dist.all_reduce(nll, group=group)
        out[cp] = {"saved_bytes": saved, "nll": nll.item(), "grad_norm": grads.norm().item(),
                   "grad": grads[:: max(1, grads.numel() // 2000)].tolist()}
        if sharding is not None:
            out[cp]["comm"] = sharding.comm
            out[cp]["comm_backward"] = {k: sharding.comm[k] - before[k] for k in before}
            out[cp]["positions"] = sharding.positions.tolist()
    (Path(spec["out"]) / f"probe_rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(1)
    if "RANK" in os.environ and not dist.is_initialized():  # (under torchrun: one group for every run)
        dist.init_process_group("gloo")
    try:
        if spec.get("probe"):
            t0 = time.perf_counter()
            probe(spec)
            if dist.get_rank() == 0:
                print(f"TIMING probe {time.perf_counter() - t0:.1f} s", flush=True)
        run_trainings(spec)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()

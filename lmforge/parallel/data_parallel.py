"""Replicated data parallelism: DDP over the data-parallel ranks, with ZeRO-1 as an option.

* ``dp_replicate = N`` (or ``dp_shard = N, zero_stage = 1``): torch's DistributedDataParallel,
  bucketed all-reduce overlapped with backward, ``no_sync`` on all but the last micro-batch of a
  step (one all-reduce of the buckets per step, whatever the accumulation); optional gradient
  compression hooks (bf16 / fp16 / PowerSGD). The gradients are views into the fp32 buckets
  (``gradient_as_bucket_view``) and are zeroed in place between steps (`DataParallel.zero_grad`),
  so the no_sync micro-batches accumulate into the buckets: one fp32 gradient copy.
* ``zero_stage = 1``: the optimizer becomes a ``ZeroRedundancyOptimizer``: each rank keeps the
  state of ~1/N of the parameters and broadcasts its updated share.

Every rank holds whole, identical gradients after the all-reduce, so clipping needs no collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.config import Config
from lmforge.model.transformer import Transformer
from lmforge.parallel.layout import Layout
from lmforge.parallel.mesh import DistInfo


class DataParallel(Layout):
    name = "ddp"
    data_parallel = True

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str):
        super().__init__(model, cfg, dist_info, precision)
        self.zero1 = cfg.parallel.zero_stage == 1
        if self.zero1:
            self.name = "zero1"
        self.module = apply_ddp(model, cfg, dist_info)

    def micro_batch_context(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.module.no_sync()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return zero1(optimizer) if self.zero1 else optimizer

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the gradients in place (ZeroRedundancyOptimizer too: its param_groups hold every
        parameter). They are views into DDP's fp32 all-reduce buckets (gradient_as_bucket_view), and
        the next step's no_sync micro-batches accumulate into them: one fp32 gradient copy.
        set_to_none would let those micro-batches build fresh gradients beside the buckets, a second
        fp32 copy until the step's last backward copies them in."""
        optimizer.zero_grad(set_to_none=False)

    def describe(self) -> Iterator[str]:
        hook = self.cfg.parallel.ddp_comm_hook
        yield (f"data parallel: DDP over {self.dp} ranks" + (", ZeRO-1 (optimizer state sharded)" if self.zero1 else "")
               + (f", {hook} gradient compression" if hook != "none" else ""))


def apply_ddp(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    """DistributedDataParallel over the data-parallel (x context-parallel) ranks, with the configured
    compression hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # RoPE tables are deterministic buffers: nothing to sync in forward (torch 2.13 renamed the
    # switch; `forward_sync_buffers=False` still syncs them once at construction, which is harmless
    # for identical tables; GPU images may have an older torch)
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
               else {"broadcast_buffers": False})
    # gradient_as_bucket_view: the gradients are views into the all-reduce buckets, so the fp32
    # gradients exist once (the default, False, keeps the buckets as a second fp32 copy: 4 B/param)
    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
              process_group=info.dp_cp_group, gradient_as_bucket_view=True, **no_sync)
    hook = cfg.parallel.ddp_comm_hook
    if hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(state=None, hook=bf16_compress_hook)
    elif hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(state=None, hook=fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=info.dp_cp_group, matrix_approximation_rank=cfg.parallel.powersgd_rank,
                                   start_powerSGD_iter=2, random_seed=cfg.train.seed)
        ddp.register_comm_hook(state, serialized_powersgd_hook)
    return ddp


def serialized_powersgd_hook(state, bucket):
    """torch's powerSGD_hook, finished before the next bucket's hook starts. Its second all-reduce
    (of Q) is issued from a callback of the first, on the communication thread, while autograd may
    already be issuing the next bucket's first all-reduce (of P): the two ranks can then call the
    group's collectives in different orders, which gloo reports as "Received data size doesn't match
    expected size" (a hang or worse on NCCL). Seen with the tiny preset under DDP (two buckets: DDP's
    first bucket is 1 MB) within a few steps; a model in one bucket never showed it. Waiting here
    costs the overlap of one bucket's compression with the next bucket's backward only."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    future = psgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


def zero1(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` rebuilt as a ZeroRedundancyOptimizer: each rank keeps the state of ~1/N params."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)

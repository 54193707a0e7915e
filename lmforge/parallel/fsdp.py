"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``): ZeRO-2/3 and HSDP.

``fully_shard`` wraps every transformer block, then the root, on the data-parallel sub-mesh:
("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP (shard within a group, replicate across
groups). ``reshard_after_forward`` true = ZeRO-3 (parameters gathered again in backward), false =
ZeRO-2-like. Mixed precision is FSDP2's ``MixedPrecisionPolicy``: parameters are all-gathered
directly in bf16/fp16 (one 16-bit copy of a block at a time, no autocast casts) and gradients
reduced in fp32 into the fp32 master shards.

Gradient accumulation (`micro_batch_sync`, around each micro-batch of a step): by default FSDP2
reduces no gradient until the step's last micro-batch (`set_requires_gradient_sync(False)` on the
others), so a step reduce-scatters the fp32 gradients once (and HSDP all-reduces them across
replicas once) whatever the accumulation, instead of once per micro-batch. The memory trade: between
micro-batches each rank holds the *unsharded* fp32 gradients of its parameters (4 B per parameter
of its stage and TP share, as DDP does; FSDP2 accumulates them in `reduce_dtype`), where the
per-micro-batch reduction kept only the 1/N shards. `parallel.fsdp_reduce_every_micro_batch = true`
restores the per-micro-batch reduce-scatter where memory demands it (HSDP then still all-reduces
across replicas only on the last micro-batch: `set_requires_all_reduce`). Pipelined layouts need
neither: torch.distributed.pipelining's schedule turns FSDP2's gradient sync off for every
micro-batch's backward itself and reduces once after the last (PipelineStage's
`backward_maybe_with_nosync` / `perform_reduce_grad`), keeping the stage's gathered parameters too
(`set_reshard_after_backward(False)`). `lmforge plan` counts the held gradients
(`fsdp_accumulated_gradients`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.config import Config
from lmforge.model.mtp import mtp_blocks
from lmforge.model.transformer import Transformer
from lmforge.parallel.expert_parallel import shard_experts
from lmforge.parallel.layout import ShardedLayout
from lmforge.parallel.mesh import DistInfo

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}


class FullyShard(ShardedLayout):
    name = "fsdp"

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str):
        super().__init__(model, cfg, dist_info, precision)
        apply_fsdp(model, cfg, dist_info, precision)

    def micro_batch_context(self, last: bool) -> contextlib.AbstractContextManager:
        return micro_batch_sync(self.model, self.cfg, last)

    def describe(self) -> Iterator[str]:
        yield fsdp_description(self.cfg)


def fsdp_description(cfg: Config) -> str:
    p = cfg.parallel
    shards = f"{p.dp_shard * p.cp} shards" + (f" (dp_shard {p.dp_shard} x cp {p.cp})" if p.cp > 1 else "")
    hsdp = f"HSDP ({p.dp_replicate} replicas x {shards})" if p.dp_replicate > 1 else shards
    stage = ("ZeRO-1 (optimizer state and fp32 weights sharded, parameters gathered for the whole step)"
             if p.zero_stage == 1  # (under tp / pp: lmforge.config.sections.zero1_through_fsdp)
             else "ZeRO-3" if reshard_after_forward(cfg) else "ZeRO-2")
    sync = ("gradients reduced after every micro-batch" if p.fsdp_reduce_every_micro_batch
            else "gradients reduced once per step (unsharded fp32 gradients held between micro-batches)")
    if cfg.grad_accum_steps == 1 or p.pp > 1:
        sync = ""  # (one micro-batch: nothing to choose; pipelines: torch's schedule reduces once per step)
    return f"FSDP2 fully_shard: {hsdp}, {stage}" + (", CPU offload" if p.cpu_offload else "") + (
        f", {sync}" if sync else "")


@contextlib.contextmanager
def micro_batch_sync(module: nn.Module, cfg: Config, last: bool) -> Iterator[None]:
    """Around one micro-batch's forward + backward of a step on `module` (FSDP2's root; any other
    module: nothing to do): gradients are reduced only in the step's last backward, or with
    parallel.fsdp_reduce_every_micro_batch reduce-scattered in every backward (HSDP's all-reduce
    across replicas still only in the last). See the module docstring for the memory trade."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        if cfg.parallel.fsdp_reduce_every_micro_batch:
            module.set_requires_gradient_sync(True)
            module.set_requires_all_reduce(last)  # (HSDP; a no-op without a replicate dim)
        else:
            module.set_requires_gradient_sync(last)  # (HSDP: reduce-scatter and all-reduce together)
    yield


def reshard_after_forward(cfg: Config) -> bool:
    """Whether FSDP2 frees the gathered parameters after each forward. Never under a zero-bubble
    pipeline schedule (parallel.pp_schedule interleaved-zb / zbv / dualpipev): torch's split backward
    finds the weights in the stage module's parameters (`stage_backward_input`), which are the
    gathered ones only while they stay gathered; a pipeline stage keeps them gathered from one
    micro-batch to the next anyway (torch's schedule: set_reshard_after_backward(False)), so this costs
    no memory there."""
    p = cfg.parallel
    if p.split_backward:
        return False
    if p.zero_stage in (1, 2):  # (1: ZeRO-1 under tp / pp, lmforge.config.sections.zero1_through_fsdp)
        return False
    if p.zero_stage == 3:
        return True
    return p.reshard_after_forward


def apply_fsdp(model: nn.Module, cfg: Config, info: DistInfo, precision: str,
               ignored: set[nn.Parameter] | None = None) -> nn.Module:
    """fully_shard every transformer block of `model` (a Transformer or a pipeline stage chunk), then
    `model` itself, on the data-parallel sub-mesh (sharded over dp_shard x cp under context
    parallelism: the CP ranks hold the same parameters). `ignored`: root parameters FSDP2 leaves
    whole (its caller reduces their gradients: a tied weight two stage chunks share)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    p = cfg.parallel
    shard = "dp_shard_cp" if p.cp > 1 else "dp_shard"
    mesh = info.sub_mesh("dp_replicate", shard) if p.dp_replicate > 1 else info.sub_mesh(shard)
    kw: dict = {"mesh": mesh}
    # 16-bit gathers of every parameter (embeddings and norms too), fp32 gradient reduction into the fp32
    # shards; bf16-pure then runs the forward without autocast, in what was gathered (lmforge.train.precision)
    if precision in LOW_PRECISION:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)
    if p.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    reshard = reshard_after_forward(cfg)
    for block in [*model.blocks.values(), *mtp_blocks(model)]:  # (+ multi-token prediction's blocks)
        shard_experts(block, info, reshard_after_forward=reshard,  # (EP: over the expert replicas)
                      **{k: v for k, v in kw.items() if k != "mesh"})
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, ignored_params=ignored, **kw)
    return model

"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``): ZeRO-2/3 and HSDP.

``fully_shard`` wraps every transformer block, then the root, on the data-parallel sub-mesh:
("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP (shard within a group, replicate across
groups). ``reshard_after_forward`` true = ZeRO-3 (parameters gathered again in backward), false =
ZeRO-2-like. Mixed precision is FSDP2's ``MixedPrecisionPolicy``: parameters are all-gathered
directly in bf16/fp16 (one 16-bit copy of a block at a time, no autocast casts) and gradients
reduced in fp32 into the fp32 master shards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lmforge.config import Config
from lmforge.model.transformer import Transformer
from lmforge.parallel.layout import ShardedLayout
from lmforge.parallel.mesh import DistInfo

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FullyShard(ShardedLayout):
    name = "fsdp"

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str):
        super().__init__(model, cfg, dist_info, precision)
        apply_fsdp(model, cfg, dist_info, precision)

    def describe(self) -> Iterator[str]:
        yield fsdp_description(self.cfg)


def fsdp_description(cfg: Config) -> str:
    p = cfg.parallel
    shards = f"{p.dp_shard * p.cp} shards" + (f" (dp_shard {p.dp_shard} x cp {p.cp})" if p.cp > 1 else "")
    hsdp = f"HSDP ({p.dp_replicate} replicas x {shards})" if p.dp_replicate > 1 else shards
    stage = "ZeRO-3" if reshard_after_forward(cfg) else "ZeRO-2"
    return f"FSDP2 fully_shard: {hsdp}, {stage}" + (", CPU offload" if p.cpu_offload else "")


def reshard_after_forward(cfg: Config) -> bool:
    p = cfg.parallel
    if p.zero_stage == 2:
        return False
    if p.zero_stage == 3:
        return True
    return p.reshard_after_forward


def apply_fsdp(model: nn.Module, cfg: Config, info: DistInfo, precision: str) -> nn.Module:
    """fully_shard every transformer block of `model` (a Transformer or a pipeline stage chunk), then
    `model` itself, on the data-parallel sub-mesh (sharded over dp_shard x cp under context
    parallelism: the CP ranks hold the same parameters)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    p = cfg.parallel
    shard = "dp_shard_cp" if p.cp > 1 else "dp_shard"
    mesh = info.sub_mesh("dp_replicate", shard) if p.dp_replicate > 1 else info.sub_mesh(shard)
    kw: dict = {"mesh": mesh}
    if precision in LOW_PRECISION:  # 16-bit gathers, fp32 gradient reduction into the fp32 shards
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)
    if p.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    reshard = reshard_after_forward(cfg)
    for block in model.blocks.values():
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model

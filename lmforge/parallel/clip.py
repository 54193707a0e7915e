"""Global gradient-norm clipping for every layout.

`clip_grad_norm_` is torch's clip for a model whose every rank holds whole, identical gradients
(one process, DDP, ZeRO-1: the norm needs no communication). `clip_grad_norm_sharded_` is the one
for gradients split across ranks (FSDP2 shards, tensor-parallel DTensors, pipeline stages): each
gradient element is counted exactly once in the world, and one SUM all-reduce of the squared
norms gives the norm of the whole model. torch's `clip_grad_norm_` has no notion of pipeline
stages or of a gradient replicated over some mesh dims and sharded over others, hence this one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmforge.parallel.mesh import DistInfo


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's global L2 norm + clip (min(1, max_norm / (norm + 1e-6))); returns the norm."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


@torch.no_grad()
def clip_grad_norm_sharded_(params: list[nn.Parameter], max_norm: float, info: DistInfo,
                            uncounted: list[nn.Parameter] = ()) -> torch.Tensor:
    """Global gradient L2 norm over every TP shard, FSDP shard and pipeline stage, then clip.

    A local shard of a DTensor gradient counts on the ranks whose coordinate is 0 along the mesh
    dims where it is *replicated* (and along the dp/cp/tp dims its mesh does not span; a flattened
    dim such as FSDP's "dp_shard_cp" spans its parts); a plain tensor (replicated over dp, cp and tp,
    e.g. a norm weight without sequence parallelism) counts on dp = cp = tp = 0 of its pipeline stage. Partial (unreduced) DTensor gradients, which sequence parallelism leaves
    on replicated norm weights, are all-reduced to Replicate first, so the optimizer sees the true
    gradient. The squared norm is summed on the training device (FSDP2 CPU offload keeps gradients
    in host memory: their partial sums move to the device), so the all-reduce is an NCCL one on GPUs.
    `uncounted`: parameters clipped but left out of the norm (a tied weight's second copy, whose
    gradient another rank counts: lmforge.parallel.pipeline).
    """
    from torch.distributed.tensor import DTensor, Replicate

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
    coord = dict(zip(info.mesh.mesh_dim_names, info.mesh.get_coordinate()))
    replicated_dims = [d for d in info.mesh.mesh_dim_names if d != "pp"]
    sq = torch.zeros((), dtype=torch.float32, device=info.device)
    grads = []
    skip = {id(p) for p in uncounted}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = [info.dim_parts(n) for n in g.device_mesh.mesh_dim_names]  # each mesh dim's own dims
            rep = [d for ds, pl in zip(dims, g.placements) if pl.is_replicate() for d in ds]
            rep += [d for d in replicated_dims if not any(d in ds for ds in dims)]
            local = g.to_local()
        else:
            rep, local = replicated_dims, g
        grads.append(local)
        if id(p) not in skip and all(coord[d] == 0 for d in rep):
            sq += local.float().pow(2).sum().to(sq.device)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for device in {g.device for g in grads}:
        same = [g for g in grads if g.device == device]
        torch._foreach_mul_(same, coef.to(device=device, dtype=same[0].dtype))
    return total

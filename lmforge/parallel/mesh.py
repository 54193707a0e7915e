"""Process group, the DeviceMesh, and the parallel layouts (data, tensor, pipeline, async SGD).

    info = init_distributed(cfg)        # no-op outside torchrun; validates the world size first
    model = apply_ddp(model, cfg, info)  or  apply_fsdp(model, cfg, info, precision)  # per layout_kind(cfg)
    ...
    destroy_distributed()

world size = parallel.dp_replicate x parallel.dp_shard x parallel.tp x parallel.pp, laid out on one
DeviceMesh with named dims ("pp", "dp_replicate", "dp_shard", "tp"), outermost to innermost
(torchtitan's order): the TP group is neighbouring ranks (most traffic: one node / NVLink), data
parallel next, pipeline stages outermost (least traffic: point-to-point activations).
``DistInfo.dp_rank / dp_size`` are the data-parallel coordinate: all ranks of one TP group and of
one pipeline read the same micro-batches.

Layouts (every degree can be 1; all combinations below are tested against one process on gloo):

* ``dp_replicate = N``: DDP (bucketed all-reduce overlapped with backward; ``no_sync`` on all but
  the last micro-batch; optional bf16 / fp16 / PowerSGD compression hooks).
* ``dp_shard = N, zero_stage = 1``: DDP + ``ZeroRedundancyOptimizer`` (optimizer state sharded).
* ``dp_shard = N`` (zero_stage 0/2/3): FSDP2 ``fully_shard`` on every transformer block, then the
  root. ``reshard_after_forward`` true = ZeRO-3, false = ZeRO-2-like.
* both > 1 (zero_stage 0/2/3): HSDP on the 2-D mesh ("dp_replicate", "dp_shard").
* ``tp = T`` (lmforge.parallel.tensor_parallel): DTensor column/row-parallel attention and MLP,
  vocab-parallel embedding, ``loss_parallel`` cross-entropy; ``sequence_parallel`` shards the
  norms' activations along the sequence. With data parallelism: FSDP2 on the dp sub-mesh after TP
  (2-D FSDP x TP; use dp_shard, not dp_replicate).
* ``pp = P`` (lmforge.parallel.pipeline): ``torch.distributed.pipelining`` stages of consecutive
  blocks, GPipe / 1F1B / interleaved 1F1B (``pp_virtual_stages`` chunks per rank); each stage
  chunk is TP-sharded (TP x PP) and/or wrapped with FSDP2 on the dp sub-mesh (DP x PP; pure
  replication is FSDP2 on a (dp_replicate, dp_shard = 1) mesh, as DDP's bucket rebuild breaks
  under a pipeline schedule). Untied embeddings only.
* ``async_sgd`` (lmforge.parallel.param_server): rank 0 parameter server, other ranks workers,
  point-to-point push/pull with a staleness bound.

With tp / pp > 1, evaluation, sampling and the saved weights use a full model gathered on every
rank (DTensor ``full_tensor`` + an all-gather of the stages' state dicts over the pp group), and
the gradient norm for clipping is summed over every shard and stage exactly once
(``clip_grad_norm_model_parallel``).

Gradient scale: DDP and FSDP both *average* gradients over the data-parallel ranks. The trainer
divides every rank's summed token loss by the token count of the whole global step (all-reduced
over the dp group) and multiplies by the dp size, so the averaged gradient is exactly that of one
big batch; TP ranks and pipeline stages share a dp coordinate and do not change the count.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config, ConfigError

log = logging.getLogger("lmforge.parallel")


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost -> innermost (torchtitan's order)


@dataclass
class DistInfo:
    """Where this process sits. Single process: rank 0 of 1, no process group, no mesh.

    ``mesh`` is one DeviceMesh with dims ("pp", "dp_replicate", "dp_shard", "tp"): TP innermost
    (neighbouring ranks, the most traffic), then data parallel, pipeline outermost. Ranks of one TP
    group and of one pipeline (all its stages) share a dp_rank and read the same data.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: object | None = None  # torch DeviceMesh with dims MESH_DIMS
    backend: str | None = None
    dp_rank: int = 0   # data-parallel coordinate: dp_replicate index x dp_shard + dp_shard index
    dp_size: int = 1   # dp_replicate x dp_shard (async SGD: the number of workers)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.backend is not None

    def sub_mesh(self, *names: str):
        """The sub-mesh over `names` (e.g. "tp", or ("dp_replicate", "dp_shard"))."""
        return self.mesh[names[0] if len(names) == 1 else names]

    def group(self, name: str):
        """Process group of one mesh dim ("pp", "tp", "dp_replicate", "dp_shard")."""
        return self.mesh.get_group(name)

    @property
    def dp_group(self):
        """Process group of all data-parallel ranks of this TP/PP coordinate (None = the world)."""
        if self.mesh is None or self.dp_size == self.world_size:
            return None
        sizes = dict(zip(self.mesh.mesh_dim_names, self.mesh.mesh.shape))
        if sizes["dp_replicate"] == 1 or sizes["dp_shard"] == 1:
            return self.group("dp_shard" if sizes["dp_replicate"] == 1 else "dp_replicate")
        return self.mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_layout(cfg: Config, world_size: int, cuda: bool) -> None:
    """Up-front checks of the parallel layout against the launch (no collective involved)."""
    p = cfg.parallel
    if p.world_size != world_size:
        how = ("torchrun started " f"{world_size} process(es)") if world_size > 1 or launched_by_torchrun() \
            else "this is a single process (not launched by torchrun)"
        raise ConfigError(
            f"the parallel layout needs parallel.dp_replicate ({p.dp_replicate}) x parallel.dp_shard "
            f"({p.dp_shard}) x parallel.tp ({p.tp}) x parallel.pp ({p.pp}) = {p.world_size} processes, but "
            f"{how} (world size {world_size}); launch with `torchrun --nproc-per-node {p.world_size} -m lmforge "
            f"train ...` or change the layout so the product equals {world_size}.")
    if p.ddp_comm_hook == "bf16" and not cuda:
        raise ConfigError(
            "parallel.ddp_comm_hook = 'bf16': torch's bf16_compress_hook only runs with CUDA + NCCL; on a CPU "
            "(gloo) run use parallel.ddp_comm_hook = 'fp16' or 'powersgd'.")
    if p.cpu_offload and not cuda:
        raise ConfigError(
            "parallel.cpu_offload = true needs a CUDA GPU: FSDP2's CPUOffloadPolicy moves shards between GPU "
            "and CPU memory, and on a CPU-only run the parameters already live in CPU memory; set "
            "parallel.cpu_offload = false.")


def init_distributed(cfg: Config) -> DistInfo:
    """Form the process group and device mesh when launched under torchrun; else a no-op.

    The world size is validated against the config *before* any collective, so a wrong
    ``--nproc-per-node`` is a clear ConfigError on every rank rather than a hang.
    """
    cuda_wanted = cfg.train.device.startswith("cuda") or (cfg.train.device == "auto" and torch.cuda.is_available())
    if not launched_by_torchrun():
        check_layout(cfg, 1, cuda_wanted)
        return DistInfo()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_layout(cfg, world, cuda_wanted)
    if cuda_wanted:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
    from torch.distributed.device_mesh import init_device_mesh

    p = cfg.parallel
    shape = (p.pp, p.dp_replicate, p.dp_shard, p.tp)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
    dp_rank, dp_size = coord["dp_replicate"] * p.dp_shard + coord["dp_shard"], p.dp
    if p.async_sgd:  # rank 0 serves parameters; workers 1..N-1 split the data N-1 ways
        dp_rank, dp_size = max(rank - 1, 0), world - 1
    log.info("distributed: %d ranks, backend %s, mesh pp=%d x dp_replicate=%d x dp_shard=%d x tp=%d, timeout %.0f s",
             world, backend, p.pp, p.dp_replicate, p.dp_shard, p.tp, p.timeout_s)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, mesh=mesh, backend=backend,
                    dp_rank=dp_rank, dp_size=dp_size, tp_rank=coord["tp"], tp_size=p.tp, pp_rank=coord["pp"],
                    pp_size=p.pp)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def layout_kind(cfg: Config) -> str:
    """'single', 'ddp', 'zero1' or 'fsdp' (FSDP2 incl. HSDP)."""
    p = cfg.parallel
    if p.dp == 1:
        return "single"
    if p.dp_shard > 1 and p.zero_stage != 1:
        return "fsdp"
    return "zero1" if p.zero_stage == 1 else "ddp"


def reshard_after_forward(cfg: Config) -> bool:
    p = cfg.parallel
    if p.zero_stage == 2:
        return False
    if p.zero_stage == 3:
        return True
    return p.reshard_after_forward


def apply_ddp(model: nn.Module, cfg: Config, info: DistInfo) -> nn.Module:
    """DistributedDataParallel over all ranks, with the configured compression hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
              broadcast_buffers=False, process_group=info.dp_group)  # RoPE caches are deterministic buffers: nothing to broadcast
    hook = cfg.parallel.ddp_comm_hook
    if hook == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(state=None, hook=bf16_compress_hook)
    elif hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp.register_comm_hook(state=None, hook=fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.parallel.powersgd_rank,
                                   start_powerSGD_iter=2, random_seed=cfg.train.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp


def apply_fsdp(model: nn.Module, cfg: Config, info: DistInfo, precision: str) -> nn.Module:
    """FSDP2: fully_shard every transformer block, then the root (HSDP on a 2-D mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    p = cfg.parallel
    mesh = info.sub_mesh("dp_replicate", "dp_shard") if p.dp_replicate > 1 else info.sub_mesh("dp_shard")
    kw: dict = {"mesh": mesh}
    if precision == "bf16":  # bf16 compute copies of the params, gradients reduced in fp32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if p.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    reshard = reshard_after_forward(cfg)
    for block in model.blocks.values():  # (a pipeline stage: only the blocks it holds)
        fully_shard(block, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model


def wrap_optimizer_zero1(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Rebuild `optimizer` as a ZeroRedundancyOptimizer: each rank keeps the state of ~1/N params."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in optimizer.param_groups]
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
    return zero


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place SUM over all ranks (identity in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient L2 norm (over *all* shards for FSDP DTensor grads) and clip to `max_norm`."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    from torch.distributed.tensor import DTensor

    if isinstance(total, DTensor):  # a partial norm per shard: reduce to the full norm
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def all_reduce_sum_group(t: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM over `group` (None = the world); identity in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


@torch.no_grad()
def clip_grad_norm_model_parallel(params: list[nn.Parameter], max_norm: float, info: DistInfo) -> torch.Tensor:
    """Global gradient L2 norm over every TP shard, FSDP shard and pipeline stage, then clip.

    Each gradient element is counted exactly once in the world: a local shard of a DTensor counts
    on the ranks whose coordinate is 0 along the mesh dims where it is *replicated* (and along the
    dp/tp dims its mesh does not span); a plain tensor (replicated over dp and tp, e.g. a norm weight
    without sequence parallelism or a DDP gradient) counts on dp = tp = 0 of its pipeline stage.
    One SUM all-reduce of the squared norms over the world then gives the norm of the full model.
    The clip coefficient is torch's: min(1, max_norm / (norm + 1e-6)). Partial (unreduced) DTensor
    gradients are all-reduced to Replicate first, so the optimizer sees the true gradient.
    """
    from torch.distributed.tensor import DTensor, Replicate

    for p in params:  # sequence parallel: replicated norm weights get Partial(sum) grads; reduce them first
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
    coord = dict(zip(info.mesh.mesh_dim_names, info.mesh.get_coordinate()))
    replicated_dims = [d for d in MESH_DIMS if d != "pp"]
    sq = torch.zeros((), dtype=torch.float32, device=info.device)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            names = g.device_mesh.mesh_dim_names
            rep = [n for n, pl in zip(names, g.placements) if pl.is_replicate()]
            rep += [d for d in replicated_dims if d not in names]
            local = g.to_local()
        else:
            rep, local = replicated_dims, g
        grads.append(local)
        if all(coord[d] == 0 for d in rep):
            sq += local.float().pow(2).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total

"""The process group and the DeviceMesh: where this process sits in the parallel layout.

    info = init_distributed(cfg)     # no-op outside torchrun; validates the world size first
    ...
    destroy_distributed()

world size = parallel.dp_replicate x parallel.dp_shard x parallel.cp x parallel.tp x parallel.pp, laid
out on one DeviceMesh with named dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"), outermost to
innermost (torchtitan's order): the TP group is neighbouring ranks (most traffic: every matmul; one
node / NVLink), context parallelism next (one K/V all-gather and one reduce-scatter per layer),
then data parallel (one gradient reduction per step), pipeline stages outermost (least traffic:
point-to-point activations). ``DistInfo.dp_rank / dp_size`` are the data-parallel coordinate: all
ranks of one TP group, of one CP group and of one pipeline read the same micro-batches (the CP
ranks then keep their own chunks of each sequence: lmforge.parallel.context_parallel).

Context parallelism adds two flattened dims (torchtitan's names), made once here on every rank:
"dp_shard_cp" (dp_shard x cp: FSDP2 shards parameters over it, since the CP ranks hold the same
parameters) and "dp_cp" (dp_replicate x dp_shard x cp: the ranks that split the step's tokens,
over which gradients are averaged and target counts and losses summed).

Backends (NCCL serves CUDA tensors only, with no receive-from-any-source and no tags):

* GPU: ``init_process_group("cuda:nccl,cpu:gloo")``: every group, the mesh's too, sends CUDA
  tensors through NCCL and host tensors through gloo (FSDP2 CPU offload's CPU gradients, say).
* CPU: gloo.
* Asynchronous SGD with more processes than GPUs on a node (the GPU suite's `async-2`: a server and
  a worker on one GPU): gloo for every group, since NCCL refuses two ranks on one device
  ("Duplicate GPU"); its messages travel on the host group anyway.
* ``DistInfo.host_group``: an explicit gloo group over all ranks for messages that are host
  tensors by nature (the checkpoint-due flag of rank 0's clock, the parameter server's flat
  parameters and gradients). It is the same gloo group on a GPU run and on a CPU run, so CPU tests
  exercise the very path a GPU run takes.
* The checkpoint manager creates its own gloo group for its background thread.
Point-to-point messages always name their source (`lmforge.parallel.param_server`).

The layouts themselves are applied by `lmforge.parallel.parallelize`.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import Config, ConfigError
from lmforge.config.launch import launch_description, launched_by_torchrun
from lmforge.config.rules import check_process_count

log = logging.getLogger("lmforge.parallel")


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost -> innermost (torchtitan's order)
FLAT_DIMS = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),  # flattened dims -> theirs
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}
# expert parallelism (parallel.ep > 1; lmforge.parallel.expert_parallel): dp_shard is made of two dims,
# the EP group innermost, and "dp_shard" is their flattened dim
EP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
EP_FLAT_DIMS = {"dp_shard": ("dp_shard_mod_ep", "ep"), "dp_shard_mod_ep_cp": ("dp_shard_mod_ep", "cp")}


@dataclass
class DistInfo:
    """Where this process sits. Single process: rank 0 of 1, no process group, no mesh.

    ``mesh`` is one DeviceMesh with dims MESH_DIMS: TP innermost (neighbouring ranks, the most
    traffic), then CP, then data parallel, pipeline outermost. Ranks of one TP group, of one CP
    group and of one pipeline (all its stages) share a dp_rank and read the same data.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # the training device (single process: train.device)
    mesh: object | None = None  # torch DeviceMesh with dims MESH_DIMS
    backend: str | None = None  # the default group's backend spec (backend_spec)
    host_group: object | None = None  # gloo group over all ranks for host tensors
    dp_rank: int = 0   # data-parallel coordinate: dp_replicate index x dp_shard + dp_shard index
    dp_size: int = 1   # dp_replicate x dp_shard (async SGD: the number of workers)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0  # expert-parallel coordinate (parallel.ep; part of the dp_shard coordinate)
    ep_size: int = 1
    flat: dict = field(default_factory=dict)  # flattened sub-meshes by name ("dp_shard_cp", "dp_cp": CP; "dp_shard": EP)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.backend is not None

    def sub_mesh(self, *names: str):
        """The sub-mesh over `names` (e.g. "tp", or ("dp_replicate", "dp_shard")); a flattened dim
        ("dp_shard_cp") alone is the mesh kept when it was made."""
        if len(names) == 1 and names[0] in self.flat:
            return self.flat[names[0]]
        return self.mesh[names[0] if len(names) == 1 else names]

    def group(self, name: str):
        """Process group of one mesh dim ("pp", "tp", "cp", "dp_replicate", "dp_shard", "ep")."""
        return self.flat[name].get_group() if name in self.flat else self.mesh.get_group(name)

    def dim_parts(self, name: str) -> tuple[str, ...]:
        """The mesh's own (not flattened) dims that dim `name` spans: "dp_shard" is ("dp_shard_mod_ep", "ep")
        under expert parallelism, "dp_shard_cp" is dp_shard's parts and "cp"."""
        parts = EP_FLAT_DIMS if self.ep_size > 1 else {}
        return tuple(q for d in FLAT_DIMS.get(name, (name,)) for q in parts.get(d, (d,)))

    @property
    def replicas(self) -> int:
        """The size of the mesh's "dp_replicate" dim (HSDP's replica groups; 1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size(self.mesh.mesh_dim_names.index("dp_replicate"))

    @property
    def dp_group(self):
        """Process group of all data-parallel ranks of this TP/PP coordinate (None = the world)."""
        if self.mesh is None or self.dp_size == self.world_size:
            return None
        if self.replicas == 1 or self.replicas == self.dp_size:
            return self.group("dp_shard" if self.replicas == 1 else "dp_replicate")
        if "dp" not in self.flat:  # (made once, on every rank alike: dp_group is asked for on all ranks)
            self.flat["dp"] = self.mesh[("dp_replicate",) + self.dim_parts("dp_shard")]._flatten("dp")
        return self.flat["dp"].get_group()

    @property
    def dp_cp_size(self) -> int:
        """Ranks that split the step's tokens: data parallel x context parallel."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_group(self):
        """Process group of the ranks that hold the same parameters and split the step's tokens: the
        data-parallel ranks and, under context parallelism, the CP ranks (they hold other tokens of the
        same sequences). Gradients are averaged and target counts summed over it (None = the world)."""
        if self.cp_size == 1:
            return self.dp_group
        return None if self.dp_cp_size == self.world_size else self.flat["dp_cp"].get_group()


def check_layout(cfg: Config, world_size: int, cuda: bool) -> None:
    """Up-front checks of the parallel layout against the launch (no collective involved)."""
    p = cfg.parallel
    check_process_count(cfg, world_size, launch_description(world_size))
    if p.ddp_comm_hook == "bf16" and not cuda:
        raise ConfigError(
            "parallel.ddp_comm_hook = 'bf16': torch's bf16_compress_hook only runs with CUDA + NCCL; on a CPU "
            "(gloo) run use parallel.ddp_comm_hook = 'fp16' or 'powersgd'.")
    if p.fsdp and p.world_size == 1 and not launched_by_torchrun():
        raise ConfigError(
            f"parallel.zero_stage = {p.zero_stage} with one process applies FSDP2 at shard degree 1, which needs a "
            f"process group: launch with `torchrun --nproc-per-node 1 -m lmforge train ...`, or set "
            f"parallel.zero_stage = 0.")
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
        return DistInfo(device=resolve_device(cfg.train.device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_layout(cfg, world, cuda_wanted)
    device = torch.device("cpu")
    if cuda_wanted:  # one GPU per process; more processes than GPUs share them round-robin (NCCL may refuse)
        count = torch.cuda.device_count()
        if local_rank >= count:
            log.warning("distributed: local rank %d of a node with %d GPU(s) shares cuda:%d", local_rank, count,
                        local_rank % count)
        device = torch.device("cuda", local_rank % count)
        torch.cuda.set_device(device)
    shared_gpu = device.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    backend = backend_spec(device.type, shared_gpu=shared_gpu and cfg.parallel.async_sgd)
    if backend == "gloo" and device.type == "cuda" and rank == 0:
        log.warning("distributed: %s processes share %d GPU(s); NCCL refuses two ranks on one device "
                    "(\"Duplicate GPU\"), so asynchronous SGD's default group is gloo (its per-step "
                    "messages are host tensors on the gloo host group either way)",
                    os.environ.get("LOCAL_WORLD_SIZE"), torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout,
                                **({"device_id": device} if "nccl" in backend else {}))
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    p = cfg.parallel
    if p.ep > 1:  # (lmforge.parallel.expert_parallel: the EP group is the innermost part of dp_shard)
        mesh = init_device_mesh(device.type, (p.pp, p.dp_replicate, p.dp_shard // p.ep, p.ep, p.cp, p.tp),
                                mesh_dim_names=EP_MESH_DIMS)
        coord = dict(zip(EP_MESH_DIMS, mesh.get_coordinate()))
        coord["dp_shard"] = coord["dp_shard_mod_ep"] * p.ep + coord["ep"]
        flat = {name: mesh[dims]._flatten(name) for name, dims in EP_FLAT_DIMS.items() if p.cp > 1 or "cp" not in dims}
        if p.cp > 1:  # (FSDP2 over dp_shard x cp, the token count over dp_replicate x dp_shard x cp: every part)
            flat["dp_shard_cp"] = mesh["dp_shard_mod_ep", "ep", "cp"]._flatten("dp_shard_cp")
            flat["dp_cp"] = mesh["dp_replicate", "dp_shard_mod_ep", "ep", "cp"]._flatten("dp_cp")
    else:
        mesh = init_device_mesh(device.type, (p.pp, p.dp_replicate, p.dp_shard, p.cp, p.tp), mesh_dim_names=MESH_DIMS)
        coord = dict(zip(MESH_DIMS, mesh.get_coordinate()))
        flat = {name: mesh[dims]._flatten(name) for name, dims in FLAT_DIMS.items() if name != "dp"} if p.cp > 1 else {}
    dp_rank, dp_size = coord["dp_replicate"] * p.dp_shard + coord["dp_shard"], p.dp
    if p.async_sgd:  # rank 0 serves parameters; workers 1..N-1 split the data N-1 ways
        dp_rank, dp_size = max(rank - 1, 0), world - 1
    log.info("distributed: %d ranks, backend %s, mesh pp=%d x dp_replicate=%d x dp_shard=%d%s x cp=%d x tp=%d, "
             "timeout %.0f s", world, backend, p.pp, p.dp_replicate, p.dp_shard,
             f" (= {p.dp_shard // p.ep} x ep {p.ep})" if p.ep > 1 else "", p.cp, p.tp, p.timeout_s)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, mesh=mesh, backend=backend,
                    host_group=host_group, dp_rank=dp_rank, dp_size=dp_size, tp_rank=coord["tp"], tp_size=p.tp, pp_rank=coord["pp"],
                    pp_size=p.pp, cp_rank=coord["cp"], cp_size=p.cp, ep_rank=coord.get("ep", 0), ep_size=p.ep,
                    flat=flat)


def resolve_device(name: str) -> torch.device:
    """train.device -> a torch device ('auto': CUDA when available, else the CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device = {name!r} but no CUDA device is available; use 'cpu' or 'auto'.")
    return device


def folder_is_shared(folder: Path, info: DistInfo) -> bool:
    """Whether every rank sees the same `folder` (one file system), or nodes have disks of their own:
    rank 0 leaves a uniquely named probe file in the folder's nearest existing ancestor and every rank
    looks for it (over the host gloo group). True outside torchrun."""
    if not info.distributed:
        return True
    token = [uuid.uuid4().hex if info.rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=info.host_group)
    anchor = Path(folder).expanduser().absolute()
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    probe = anchor / f".lmforge-shared-{token[0]}"
    if info.rank == 0:
        probe.touch()
    dist.barrier(group=info.host_group)
    seen = torch.tensor([int(probe.exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=info.host_group)
    dist.barrier(group=info.host_group)
    if info.rank == 0:
        probe.unlink(missing_ok=True)
    return bool(seen.item())


def backend_spec(device_type: str, shared_gpu: bool = False) -> str:
    """The default process group's backend for a run on `device_type`: NCCL for CUDA tensors with
    gloo beside it for host tensors (torchtitan's choice), plain gloo on CPU. `shared_gpu`: ranks
    share a GPU in a layout whose default group carries no per-step traffic (asynchronous SGD:
    init_distributed), where NCCL would refuse ("Duplicate GPU"): gloo, which also carries CUDA
    tensors (through host memory)."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" and not shared_gpu else "gloo"


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over `group` (None = the world); identity in a single process."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t

"""From a model on the meta device to this rank's part of it on a real device, filled in place.

    model = Transformer(cfg) under torch.device("meta")     # no memory, whatever the size
    ... split, shard (pipeline stages, DTensor TP, FSDP2 fully_shard) on meta ...
    materialise(model, device, init_source(cfg, seed))       # this rank's shards only

`materialise` allocates every parameter's *local* tensor (a plain parameter whole, a DTensor its
shard: FSDP2's or TP's or both), asks a source for exactly the part of the full tensor that this
rank holds (`local_index`: the kept indices along each dim), and copies it in: at most one
parameter's local part exists besides the model. Sources give the values of any part of any
parameter by its name in the unwrapped model (the names of a one-process model: wrappers'
prefixes removed): the random initialisation (lmforge.model.init) or pre-trained weights read
slice by slice (lmforge.train.finetune).

Parameters shared by several modules (tied embeddings) stay shared: `to_empty` allocates each
occurrence separately, so the ties are recorded before and restored after. Non-persistent buffers
(RoPE tables) are recomputed by the model's `reset_buffers`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmforge.model.init import Index
from lmforge.model.sharded import local_part

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")

# (name in the unwrapped model, owning module, the module's unwrapped name, the parameter's own name,
#  full shape, kept indices, dtype) -> the values at those indices (CPU or device)
Source = Callable[[str, nn.Module, str, str, tuple, Index, torch.dtype], torch.Tensor]


def unwrapped_name(name: str) -> str:
    """A parameter's name without activation-checkpoint / compile / DDP wrapper prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def local_index(t: torch.Tensor) -> Index:
    """Indices along each dim of the full tensor that this rank's local part of `t` holds (None:
    all). A plain tensor is whole; a DTensor's shards along one dim follow its placements in mesh
    order (FSDP2 over TP is a _StridedShard), found by distributing the positions along that dim
    with the same placements (no communication: src_data_rank=None)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return (None,) * t.ndim
    out: list[torch.Tensor | None] = []
    for d in range(t.ndim):
        along = []
        for p in t.placements:
            if isinstance(p, _StridedShard) and p.dim == d:
                along.append(_StridedShard(0, split_factor=p.split_factor))
            elif isinstance(p, Shard) and p.dim == d:
                along.append(Shard(0))
            else:  # (a shard along another dim, or a replica)
                assert isinstance(p, (Shard, _StridedShard, Replicate)), f"placement {p} cannot be materialised"
                along.append(Replicate())
        if all(isinstance(p, Replicate) for p in along):
            out.append(None)
            continue
        positions = torch.arange(t.shape[d], device=t.device_mesh.device_type)
        out.append(distribute_tensor(positions, t.device_mesh, along, src_data_rank=None).to_local().cpu())
    return tuple(out)


def _ties(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) slots that hold one shared parameter."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    return [group for group in slots.values() if len(group) > 1]


@torch.no_grad()
def materialise(module: nn.Module, device: torch.device | str, source: Source) -> nn.Module:
    """Allocate `module`'s parameters and buffers (this rank's shards) on `device` and fill every
    parameter from `source`, in place; returns `module`."""
    ties = _ties(module)
    module.to_empty(device=device)
    for group in ties:
        (owner, name), *others = group
        for m, n in others:
            setattr(m, n, getattr(owner, name))
    modules = dict(module.named_modules())
    for full_name, p in module.named_parameters():  # (a shared parameter once, under its first name)
        owner_name, _, own = full_name.rpartition(".")
        owner = modules[owner_name] if owner_name else module
        name = unwrapped_name(full_name)
        index = local_index(p)
        values = source(name, owner, name.rpartition(".")[0], own, tuple(p.shape), index, p.dtype)
        local = local_part(p)
        assert tuple(values.shape) == tuple(local.shape), (name, tuple(values.shape), tuple(local.shape))
        local.copy_(values)
    for m in module.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    return module

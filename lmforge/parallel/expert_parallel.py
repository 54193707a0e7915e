"""Expert parallelism (`parallel.ep`): the routed experts of every MoE layer split across ranks, tokens
sent to them and back with all-to-all; and the per-step wiring every MoE model needs under any layout.

Mesh (lmforge.parallel.mesh): EP borrows its ranks from the data-parallel shard dimension, as in
torchtitan. With ep > 1 the dim "dp_shard" is made of two, ("dp_shard_mod_ep", "ep"), outermost
first, and "dp_shard" is their flattened dim: the ep ranks of one EP group are neighbouring
data-parallel ranks, each reading its own micro-batches.

* **Experts** (`GroupedExperts` weights, experts along dim 0) become DTensors sharded `Shard(0)`
  over the "ep" sub-mesh (on the meta device, before FSDP2): EP rank j holds experts
  [j E/ep, (j+1) E/ep). `lmforge.model.materialise` then fills exactly those experts' values (the
  init draws per expert block), so every layout starts from the one-process weights.
* **FSDP2** (lmforge.parallel.fsdp) shards the dense parameters over all of "dp_shard" as before and
  each block's experts over "dp_shard_mod_ep" only (`shard_experts`): the ranks that hold a replica
  of the same experts. With dp_replicate > 1 (HSDP) both are replicated across the replica groups
  (FSDP2 on ("dp_replicate", "dp_shard") and ("dp_replicate", "dp_shard_mod_ep")): every replica
  group holds all experts, split over its own EP ranks. Their gradients are reduce-scattered
  (averaged) over exactly those ranks (and all-reduced across the replicas) and
  scaled by 1/ep (`GroupedExperts.grad_scale`, applied to the weights' gradient in backward), because
  each expert's gradient already sums the tokens of the whole EP group: the sum over all dp ranks'
  tokens x dp / N, averaged over dp / ep replicas, times 1 / ep, is the one-process gradient. (FSDP2's
  `set_gradient_divide_factor` would say the same, but its PREMUL_SUM reduction does not exist on gloo.)
* **Dispatch / combine** (`EPDispatcher`): the (token, expert) rows, sorted by expert on each rank,
  go to the rank holding their expert (`all_to_all_single` with uneven splits, after an all-to-all of
  the per-expert counts), are re-ordered expert-major, run through the local experts' grouped GEMM
  (`GroupedExperts.sorted_rows`: aligned on the device where the grouped GEMM runs), and return the
  same way; backward is the reverse all-to-all (`_AllToAll`). gloo and NCCL both implement it. This
  is the one MoE path that syncs with the host (once per layer, plus the boolean index of a capacity
  drop): all_to_all_single takes uneven split sizes as host integers, so the counts are read there,
  as torchtitan's dispatcher does; the routed path of one process or of data parallelism without EP
  reads nothing on the host (lmforge.model.moe).
* **Other dimensions.** TP shards attention only (an MoE block's feed-forward is computed whole on
  each TP rank, which hold the same tokens); pipeline stages keep their blocks' experts; the
  gradient-norm clip counts an expert shard once (lmforge.parallel.clip: its mesh dims
  "dp_shard_mod_ep" and "ep" are parts of "dp_shard"). Context parallelism: the CP ranks hold the
  same experts, so experts are FSDP2-sharded over dp_shard_mod_ep x cp and dense weights over
  dp_shard x cp; each CP rank routes its own chunks' tokens through the EP group.

Every MoE model, with or without EP (`wire_moe`): the balancing statistics are all-reduced over the
ranks that split the data (DistInfo.dp_cp_group), and `moe_step` sets the backward scale of the
aux losses for the step (data-parallel degree / micro-batches, matching the language-model loss's
normalisation: lmforge.model.loss) and afterwards collects each layer's statistics, which applies
the auxiliary-loss-free bias update (lmforge.model.moe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.moe import ExpertsFn, MoE, MoEStats, moe_layers
from lmforge.parallel.mesh import DistInfo


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


class EPDispatcher:
    """Runs a MoE layer's experts where they live: `__call__(rows, counts, experts)` with this rank's
    expert-sorted rows and per-expert counts (all E experts) -> the rows' expert outputs, same order.
    It reads the split sizes on the host once per call (all_to_all_single's uneven splits are host
    integers: inherent to it)."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        ep = self.ep
        per_rank = counts.view(ep, -1)  # (destination rank, its local expert)
        received = torch.empty_like(per_rank)  # (source rank, my local expert)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)
        send, recv = torch.stack([per_rank.sum(1), received.sum(1)]).tolist()  # (the host sync all_to_all_single needs)
        x = _AllToAll.apply(rows, recv, send, self.group)  # grouped by source rank, then local expert
        perm = expert_major(received, sum(recv))
        y = experts(x[perm], received.sum(0))
        y = y.new_zeros(y.shape).index_copy(0, perm, y)  # back to source-rank order
        return _AllToAll.apply(y, send, recv, self.group)


def expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows laid out by (source rank, expert) segments of sizes `counts` (ranks x experts; `total`
    rows in all, known on the host) -> the row indices in (expert, source rank) order."""
    ranks, experts = counts.shape
    sizes = counts.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    seg = torch.arange(ranks * experts, device=counts.device).view(ranks, experts).t().reshape(-1)
    lengths, seg_starts = sizes[seg], starts[seg]
    offset = torch.repeat_interleave(seg_starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return offset + torch.arange(total, device=counts.device)


def apply_expert_parallel(model: nn.Module, info: DistInfo) -> None:
    """On the meta model (a Transformer or what pipeline splitting left of it): split every MoE
    layer's experts over the "ep" mesh dim and give it the all-to-all dispatcher."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = info.sub_mesh("ep")
    for layer in moe_layers(model).values():
        experts = layer.experts
        assert experts.num_experts % info.ep_size == 0, (experts.num_experts, info.ep_size)
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None),
                                                          requires_grad=p.requires_grad))
        layer.dispatcher = EPDispatcher(info.group("ep"), info.ep_size)


def shard_experts(block: nn.Module, info: DistInfo, **fsdp_kw) -> None:
    """FSDP2 over the ranks that hold the same experts ("dp_shard_mod_ep") for a block's EP-split
    experts, before the block's own fully_shard (which then leaves them alone); their gradients
    scaled by 1 / ep (see the module docstring)."""
    from torch.distributed.fsdp import fully_shard

    shard = "dp_shard_mod_ep_cp" if info.cp_size > 1 else "dp_shard_mod_ep"
    for layer in moe_layers(block).values() if info.ep_size > 1 else ():  # (HSDP: replicas x the expert shards)
        mesh = info.sub_mesh("dp_replicate", shard) if info.replicas > 1 else info.sub_mesh(shard)
        fully_shard(layer.experts, mesh=mesh, **fsdp_kw)
        layer.experts.grad_scale = 1.0 / info.ep_size


def wire_moe(model: nn.Module, cfg: Config, info: DistInfo) -> None:
    """Every MoE layer's statistics all-reduced over the ranks that split the data (none in one
    process); expert parallelism when parallel.ep > 1."""
    layers = moe_layers(model)
    if not layers:
        return
    group = None
    if info.distributed and info.dp_cp_size > 1:
        group = info.dp_cp_group if info.dp_cp_group is not None else dist.group.WORLD
    for layer in layers.values():
        layer.token_group = group
    if cfg.parallel.ep > 1:
        apply_expert_parallel(model, info)


@contextlib.contextmanager
def moe_step(model: nn.Module, micro_batches: int, dp: int, out: dict) -> Iterator[None]:
    """Around one optimizer step's forwards and backwards: the aux losses' backward scale (dp / the
    step's micro-batches: the mean over micro-batches of the global-batch aux loss, against the
    data-parallel gradient averaging), then each layer's statistics into `out` (block index ->
    MoEStats; the bias update happens there)."""
    layers = moe_layers(model)
    for layer in layers.values():
        layer.aux_grad_scale = dp / micro_batches
    yield
    out.clear()
    for i, layer in layers.items():
        stats = layer.take_stats()
        if stats is not None:
            out[i] = stats


def moe_metrics(stats: dict[int, MoEStats]) -> dict[str, float | list[int]]:
    """Flat metrics of a step's MoE statistics (a host sync: read at log lines), per layer i:
    moe/i/tokens_per_expert (the step's (token, expert) assignments per expert, a list),
    moe/i/max_load (the busiest expert's assignments / the mean: 1 = balanced), moe/i/aux_loss,
    moe/i/z_loss and moe/i/seq_aux_loss (the sequence-wise balance loss; means over the micro-batches,
    before their coefficients), moe/i/dropped (assignments
    over capacity) and moe/i/dropped_frac (of all assignments)."""
    out: dict = {}
    for i, s in stats.items():
        load = s.tokens_per_expert
        mean, total = float(load.mean()), float(load.sum())
        out[f"moe/{i}/tokens_per_expert"] = [int(v) for v in load.tolist()]
        out[f"moe/{i}/max_load"] = float(load.max()) / mean if mean else 0.0
        out[f"moe/{i}/aux_loss"] = s.aux_loss
        out[f"moe/{i}/z_loss"] = s.z_loss
        out[f"moe/{i}/seq_aux_loss"] = s.seq_aux_loss
        out[f"moe/{i}/dropped"] = s.dropped
        out[f"moe/{i}/dropped_frac"] = s.dropped / total if total else 0.0
    return out


__all__ = ["EPDispatcher", "MoE", "apply_expert_parallel", "expert_major", "moe_metrics", "moe_step", "shard_experts",
           "wire_moe"]

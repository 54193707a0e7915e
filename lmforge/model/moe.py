"""Mixture-of-Experts feed-forward (`model.moe.*`): a router, routed SwiGLU experts computed with one
grouped GEMM per projection, optional shared experts, load-balancing losses and statistics.

    block.mlp = MoE(cfg)      # Transformer builds it for the blocks `cfg.moe.is_moe_layer(i)` names

One forward, for the T tokens of a micro-batch on this rank (x flattened to (T, dim)):

1. **Route.** Router logits (fp32) -> scores: softmax over the experts (Mixtral, Qwen3-MoE) or a
   sigmoid per expert (DeepSeek-V3). The top-k experts of each token are chosen on scores + the
   selection bias (`expert_bias`, a persistent buffer: zero unless the auxiliary-loss-free update
   moves it), with group-limited routing (model.moe.n_groups > 1, DeepSeek-V3's node-limited
   routing) only among the topk_groups groups of experts whose two best biased scores sum highest;
   the weights are the chosen *scores* (renormalised to sum 1 when model.moe.renormalize, times
   model.moe.route_scale).
2. **Sort.** The T x k (token, expert) assignments are sorted by expert (a stable argsort: within
   an expert, token order), which gives each expert's count and each assignment's place among its
   expert's; with a capacity factor the assignments past an expert's capacity are dropped (counted).
3. **Experts.** Each kept assignment's token row goes straight to its row in its expert's group, in
   a buffer laid out on the device: every group rounded up to the rows of 16 bytes where the grouped
   GEMM runs (8 in bf16: what torch's CUDA kernel needs; `aligned_offsets`), zero rows between, the
   buffer's size a static bound (T x k + E x 8) so nothing is read on the host. Then one
   `torch._grouped_mm` per projection (gate, up, down) with the groups' int32 end offsets: no
   Python loop over experts and no host sync in the whole routed path. Under bf16 autocast the
   experts compute in bf16: the input is cast here, and `Precision.step` holds one bf16 copy of the
   experts' weights per step as it does for the linear layers. Where the grouped GEMM cannot run
   (`grouped_mm_ok`: CUDA other than bf16 on Hopper / Blackwell, strides off the 16-byte rule) the
   groups are packed and a padded batched matmul (`torch.bmm` over (experts, most tokens of one
   expert, dim)) gives the same numbers after one host read of the offsets per layer. Under expert
   parallelism (lmforge.parallel.expert_parallel) the kept rows, sorted by expert, go through an
   all-to-all dispatch to the ranks that hold their experts and an all-to-all combine back
   (`self.dispatcher`): all_to_all_single takes host split sizes, so that path reads them once per
   layer.
4. **Combine.** Each assignment's output comes back from its row and the k slots of a token are
   summed with their weights (a fixed order: the result does not depend on where experts ran);
   shared experts (one SwiGLU of shared_experts x expert_hidden) are added, times a per-token sigmoid
   gate with model.moe.shared_gate (Qwen3-Next).

Balancing: the auxiliary loss E * sum_i f_i P_i (f_i: share of assignments to expert i, P_i: mean
router probability) and the z-loss mean(logsumexp(logits)^2) are computed over the micro-batch's
tokens of *all* ranks that split the data (one all-reduce of 2E + 4 numbers per layer: `token_group`),
so every layout optimises the same objective as one process. DeepSeek-V3's complementary
sequence-wise balance loss (model.moe.seq_aux_loss_coef; its eq. 17-20) is the same sum within each
sequence, averaged over the sequences of the micro-batch on all those ranks: per sequence s,
f_{s,i} = E / (k T) x s's assignments to expert i and P_{s,i} = the mean over s's T tokens of the
normalised scores (scores / their sum per token); a rank adds its sequences' terms (under context
parallelism a sequence's assignment counts are first summed over its CP ranks: one more all-reduce of
(sequences x E) counts per layer), so the mean is exact whatever the layout. They enter backward through
`AuxLossGrad` (Megatron's MoEAuxLossAutoScaler idea): the layer's output is unchanged, and its
backward adds the loss's gradient, scaled by `aux_grad_scale` (set by the layout per step: the
data-parallel averaging and the micro-batch count), so no training loop needs to know about it.
The reported training loss stays the language-model loss; the aux losses go to the metrics.

The per-step statistics (`MoEStats`: tokens per expert, dropped assignments, aux, z and sequence-wise losses,
summed over the step's micro-batches on the device, read on the host only at log lines) feed the
auxiliary-loss-free bias update (DeepSeek-V3: b_i += rate * sign(mean load - load_i) after each
step, the same on every rank since the counts are global) and the metrics
(lmforge.parallel.expert_parallel.moe_step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.layers import SwiGLU, current_shard

# the experts over packed rows: rows sorted by expert, counts per expert -> output rows (what expert
# parallelism's dispatcher runs: GroupedExperts.sorted_rows)
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_hidden(cfg: ModelConfig) -> int:
    return cfg.moe.expert_hidden or cfg.ffn_dim


# ---- grouped GEMM ---------------------------------------------------------------------------------

# torch's CUDA grouped GEMM: for bf16 on compute capability 9.x / 10.x torch._grouped_mm runs a CUTLASS
# kernel that takes its offsets on the device (`_grouped_mm_cuda` in aten's GroupedBlas.cpp; every
# other CUDA case goes to a per-group fallback that copies the offsets to the host). It loads by TMA,
# so where a grouped dimension is the contiguous one each group must span a multiple of 16 bytes
# (aten/src/ATen/native/cuda/GroupMMCommon.cuh asserts it on the device): in the weight gradient
# x^T @ grad_out the groups run along the contracted rows, so lmforge gives every group a multiple of
# 16 bytes of rows, 8 in bf16, whichever layout the backward picks (torchtitan aligned bf16 token
# groups to 8 rows for the same reason). An empty group made that backward hang in earlier releases
# (pytorch/pytorch#152668), so a group also gets at least one aligned block. (Read in torch's source
# and run on the CPU; not yet run on a GPU.)
GROUPED_MM_ALIGN_BYTES = 16
GROUPED_MM_CUDA_MAJORS = (9, 10)  # Hopper, Blackwell: the compute capabilities with the CUTLASS kernel


def grouped_mm_ok(x: torch.Tensor, n: int) -> bool:
    """Whether torch._grouped_mm runs x (M, K) @ w (G, K, n), w in x's dtype, here, on the device and
    without a host sync: the op exists and the row strides (K and n elements) are multiples of 16
    bytes (its rule on CPU and CUDA); on CUDA the dtype is bf16 on a GPU with the CUTLASS kernel
    (GROUPED_MM_CUDA_MAJORS), on CPU fp32 or bf16 (both run with torch 2.13). The groups' rows are
    aligned by the caller (`aligned_offsets`), so no count is read here."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    if (x.shape[1] * size) % GROUPED_MM_ALIGN_BYTES or (n * size) % GROUPED_MM_ALIGN_BYTES:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in GROUPED_MM_CUDA_MAJORS
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def aligned_offsets(counts: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of `counts[g]` rows laid out one after another, each rounded up to a multiple of `align`
    rows and, where align > 1, given at least `align` rows (an empty group too): (each group's first
    row (int64), its end offset (int32, what torch._grouped_mm takes)). Computed on the device."""
    sizes = counts if align == 1 else (counts.clamp(min=1) + align - 1) // align * align
    ends = torch.cumsum(sizes, 0)
    return ends - sizes, ends.to(torch.int32)


def aligned_rows(rows: int, groups: int, align: int) -> int:
    """A static bound on the rows `aligned_offsets` lays out for `rows` rows in `groups` groups (each
    group adds at most `align` rows), so the buffer is sized without reading the counts."""
    return rows if align == 1 else rows + groups * align


def place_rows(x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """A (rows, d) buffer holding row x[src[i]] at row dest[i] and zeros elsewhere; the dest values
    are distinct, and a dest >= rows leaves its row out (they index a discarded tail). One gather of
    x through a row index built by a scatter: its backward is index_put's accumulation into x."""
    index = torch.full((rows + src.shape[0],), x.shape[0], dtype=torch.long, device=x.device)  # (x's zero row)
    index.scatter_(0, dest, src)
    return torch.cat([x, x.new_zeros((1, x.shape[1]))])[index[:rows]]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (M, K) in groups ending at `offs` (int32, cumulative), group g times its own w[g]
    (K, N) -> (M, N): one `torch._grouped_mm`. Rows past offs[-1] are in no group: their output rows
    are left unwritten (whatever the buffer held), and nothing may read them."""
    if x.device.type == "cuda" and (w.storage_offset() * w.element_size()) % GROUPED_MM_ALIGN_BYTES:
        w = w.clone()  # (a view into a larger buffer, e.g. FSDP2's gathered parameters: TMA wants 16-byte starts)
    out = torch._grouped_mm(x.contiguous(), w, offs=offs)
    if out.requires_grad:  # its backward refuses the stride-0 gradients of e.g. `.sum()`: made contiguous
        out.register_hook(torch.Tensor.contiguous)  # (a hook, not an identity Function: the output of
        # the FSDP2-wrapped experts must not be a view; FSDP2 warns that an in-place op on one skips its hook)
    return out


def padded_bmm(x: torch.Tensor, w: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """The fallback of `grouped_matmul` where it cannot run, with the group ends on the host (`ends`:
    a host sync, read once per layer by `GroupedExperts`): scatter the rows into (G, most rows of a
    group, K) with zero padding, one `torch.bmm`, gather the real rows back; rows past the last end
    give zeros."""
    groups, m = w.shape[0], ends[-1] if ends else 0
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    past = x.new_zeros((x.shape[0] - m, w.shape[2]))
    if m == 0:
        return past
    sizes = torch.tensor(counts, device=x.device)
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), sizes, output_size=m)
    slot = torch.arange(m, device=x.device) - (torch.cumsum(sizes, 0) - sizes)[group]
    padded = x.new_zeros((groups, max(counts), x.shape[1]))
    padded[group, slot] = x[:m]
    return torch.cat([torch.bmm(padded, w)[group, slot], past])


def experts_loop(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    """Reference (and the benchmark's baseline): the SwiGLU experts one at a time, a Python loop over
    the groups of expert-sorted rows (`counts` read on the host)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        outs.append((F.silu(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e])
        start += n
    return torch.cat(outs) if outs else x.new_zeros((0, w_down.shape[-1]))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in: autocast's where it is on for x's device (what it gives
    nn.Linear; it leaves torch._grouped_mm in fp32 on the CPU with torch 2.13, so the experts cast
    their input themselves), else x's own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


# ---- modules ----------------------------------------------------------------------------------------


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as three stacked weights (experts first, so expert parallelism
    shards dim 0 and FSDP2 the next): w_gate, w_up (E, dim, hidden), w_down (E, hidden, dim)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, mode: str = "auto"):
        super().__init__()
        self.num_experts, self.mode = num_experts, mode
        self.grad_scale = 1.0  # weight-gradient factor (expert parallelism: lmforge.parallel.expert_parallel)
        self.w_gate = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's experts (a DTensor sharded over expert parallelism: its local slice), their
        gradients scaled by `grad_scale`."""
        ws = tuple(w.to_local() if hasattr(w, "to_local") else w for w in (self.w_gate, self.w_up, self.w_down))
        return ws if self.grad_scale == 1.0 else tuple(_ScaleGrad.apply(w, self.grad_scale) for w in ws)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether `forward` over rows like `x` (in the compute dtype) takes torch._grouped_mm:
        model.moe.grouped_mm 'on', or 'auto' where `grouped_mm_ok` holds (dim and hidden cover the
        three projections' strides); else the padded batched matmul."""
        if self.mode != "auto":
            return self.mode == "on"
        return grouped_mm_ok(x, self.w_gate.shape[-1])

    def row_alignment(self, x: torch.Tensor) -> int:
        """Rows per aligned block of `forward`'s groups for rows like `x`: 16 bytes of rows where the
        grouped GEMM runs (the CUDA kernel's rule, kept on every device so that the CPU runs the
        layout a GPU does), 1 for the padded batched matmul, which takes any counts."""
        return GROUPED_MM_ALIGN_BYTES // x.element_size() if self.uses_grouped_mm(x) else 1

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Rows of `x` in groups ending at `offs` (int32, cumulative; laid out by `aligned_offsets`
        with `row_alignment(x)`), group g through (local) expert g -> the outputs, row for row; rows
        past offs[-1] belong to no group and their output rows are not to be read. The weights are
        cast to x's dtype (a no-op within `Precision.step`, which copies them once per step)."""
        w_gate, w_up, w_down = (w.to(x.dtype) for w in self.local_weights())
        assert offs.shape[0] == w_gate.shape[0], (offs.shape, w_gate.shape)
        if self.uses_grouped_mm(x):
            h = F.silu(grouped_matmul(x, w_gate, offs)) * grouped_matmul(x, w_up, offs)
            return grouped_matmul(h, w_down, offs)
        ends = offs.tolist()  # (the fallback's one host sync per layer)
        h = F.silu(padded_bmm(x, w_gate, ends)) * padded_bmm(x, w_up, ends)
        return padded_bmm(h, w_down, ends)

    def sorted_rows(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """An `ExpertsFn` (what expert parallelism's dispatcher runs on the rows it received): rows
        sorted by (local) expert, `counts[g]` of them for expert g, -> their outputs, same order. Where
        the grouped GEMM runs, the rows are first laid out in aligned groups, on the device."""
        align = self.row_alignment(rows)
        starts, offs = aligned_offsets(counts, align)
        if align == 1:
            return self(rows, offs)
        index = torch.arange(rows.shape[0], device=rows.device)
        ends = torch.cumsum(counts, 0)
        expert = torch.searchsorted(ends, index, right=True)
        dest = starts[expert] + index - (ends - counts)[expert]
        return self(place_rows(rows, index, dest, aligned_rows(rows.shape[0], counts.shape[0], align)), offs)[dest]


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class AuxLossGrad(torch.autograd.Function):
    """Identity on `out` whose backward also sends `scale` as the gradient of `aux` (a scalar loss
    term of the layer), so the loss reaches the router without the training loop adding it."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


@dataclasses.dataclass
class MoEStats:
    """One MoE layer's numbers over the micro-batches of a step, summed over every rank that splits
    the data (global), kept on the device until read (no host sync per forward): `acc` = per expert
    the (token, expert) assignments, then tokens, dropped assignments, aux loss, z-loss and the
    sequence-wise balance loss, each summed over the micro-batches."""

    acc: torch.Tensor
    micro_batches: int = 0

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.acc[:-5].cpu()

    @property
    def tokens(self) -> int:
        return int(self.acc[-5])

    @property
    def dropped(self) -> int:
        return int(self.acc[-4])

    @property
    def aux_loss(self) -> float:
        """Mean over the step's micro-batches."""
        return float(self.acc[-3]) / max(self.micro_batches, 1)

    @property
    def z_loss(self) -> float:
        return float(self.acc[-2]) / max(self.micro_batches, 1)

    @property
    def seq_aux_loss(self) -> float:
        """DeepSeek-V3's sequence-wise balance loss (before its coefficient), mean over the micro-batches."""
        return float(self.acc[-1]) / max(self.micro_batches, 1)


class MoE(nn.Module):
    """The MoE feed-forward of one block (see the module docstring); input and output (..., dim)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        m = cfg.moe
        self.cfg, self.num_experts, self.top_k, self.layer = m, m.num_experts, m.top_k, layer  # (block index)
        hidden = expert_hidden(cfg)
        self.router = nn.Linear(cfg.dim, m.num_experts, bias=False)
        self.experts = GroupedExperts(m.num_experts, cfg.dim, hidden, m.grouped_mm)
        self.shared = SwiGLU(dataclasses.replace(cfg, ffn_hidden=m.shared_experts * hidden, dropout=0.0)) \
            if m.shared_experts else None
        # Qwen3-Next / Qwen3.5's shared_expert_gate (model.moe.shared_gate): one sigmoid gate per token on the
        # shared experts' output
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if m.shared_experts and m.shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(m.num_experts), persistent=True)
        # set by lmforge.parallel.expert_parallel: the all-to-all around the experts, the group of
        # ranks that split the data (global balancing statistics) and the backward scale of the aux losses
        self.dispatcher: Callable[[torch.Tensor, torch.Tensor, ExpertsFn], torch.Tensor] | None = None
        self.token_group = None
        self.aux_grad_scale = 1.0
        self.stats: MoEStats | None = None  # the step so far (training forwards only)

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()

    # ---- routing ---------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, dim) -> (router logits fp32 (T, E), scores (T, E), chosen experts (T, k), their weights
        (T, k) fp32)."""
        m = self.cfg
        logits = self.router(x).float()
        scores = logits.softmax(-1) if m.router == "softmax" else logits.sigmoid()
        _, chosen = torch.topk(self.limit_groups(scores + self.expert_bias), self.top_k, dim=-1)
        weights = scores.gather(1, chosen)
        if m.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, chosen, weights * m.route_scale

    def limit_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Group-limited routing (model.moe.n_groups > 1; DeepSeek-V3 eq. of its node-limited routing, as
        its released inference code computes it): the experts in n_groups equal groups, each group
        scored by the sum of its two highest biased scores, the topk_groups best groups kept and every
        other expert's score set to -inf, so top-k picks inside the kept groups. (T, E) -> (T, E)."""
        groups = self.cfg.n_groups
        if groups == 1:
            return biased
        per_group = biased.view(biased.shape[0], groups, -1)
        best = per_group.topk(2, dim=-1).values.sum(-1)  # (T, groups)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.cfg.topk_groups, dim=-1).indices, True)
        return per_group.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(biased)

    def capacity(self, position: torch.Tensor, counts: torch.Tensor,
                 tokens: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Capacity factor: (which assignments fit their expert's capacity, the first ones in token
        order by `position`, their place among the expert's assignments: None when dropless; the
        assignments each expert keeps)."""
        if not self.cfg.capacity_factor:
            return None, counts
        capacity = math.ceil(self.cfg.capacity_factor * tokens * self.top_k / self.num_experts)
        return position < capacity, counts.clamp(max=capacity)

    # ---- forward -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        logits, scores, chosen, weights = self.route(x)
        flat = chosen.reshape(-1)  # assignment a: token a // top_k's choice a % top_k
        order = torch.argsort(flat, stable=True)  # assignments by expert, token order within one
        first = torch.searchsorted(flat[order], torch.arange(self.num_experts + 1, device=x.device))
        counts = first.diff()  # assignments per expert (not bincount: on CUDA it reads the largest value on the host)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.shape[0], device=x.device))
        position = rank - first[flat]  # each assignment's place among its expert's, in token order
        keep, kept = self.capacity(position, counts, tokens)
        xc = x.to(compute_dtype(x))
        if self.dispatcher is None:
            slots = self.local_experts(xc, flat, position, keep, kept)
        else:
            slots = self.parallel_experts(xc, order, keep, kept)
        y = (slots.to(x.dtype).view(tokens, self.top_k, -1) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        if self.shared is not None:
            shared = self.shared(x)
            y = y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        if self.training and torch.is_grad_enabled():
            seqs = shape[0] if len(shape) == 3 else 1
            y = self.balance(y, logits, scores, counts, (counts - kept).sum().float(), tokens,
                             self.sequence_counts(chosen, seqs))
        return y.view(shape)

    def sequence_counts(self, chosen: torch.Tensor, seqs: int) -> torch.Tensor | None:
        """Each sequence's assignments per expert (seqs, E), float, summed over the CP ranks that hold
        parts of it (context parallelism: one all-reduce); None when the sequence-wise loss is off."""
        if not self.cfg.seq_aux_loss_coef:
            return None
        seq_of = torch.arange(chosen.shape[0], device=chosen.device) // (chosen.shape[0] // seqs)
        index = (seq_of.unsqueeze(1) * self.num_experts + chosen).reshape(-1)
        counts = torch.zeros(seqs * self.num_experts, device=chosen.device).index_add_(
            0, index, torch.ones(index.shape[0], device=chosen.device)).view(seqs, self.num_experts)
        shard = current_shard()
        if shard is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=shard.group)
        return counts

    def local_experts(self, x: torch.Tensor, flat: torch.Tensor, position: torch.Tensor, keep: torch.Tensor | None,
                      kept: torch.Tensor) -> torch.Tensor:
        """Every assignment's expert output (tokens x top_k, dim), all experts on this rank, without a
        host sync: the token rows go straight into the experts' groups, aligned for the grouped GEMM
        (`GroupedExperts.row_alignment`) in a buffer of a static size, with int32 offsets
        (`aligned_offsets`); an assignment dropped for capacity gets no row and a zero output."""
        assignments = flat.shape[0]
        align = self.experts.row_alignment(x)
        starts, offs = aligned_offsets(kept, align)
        rows = aligned_rows(assignments, self.num_experts, align)
        row = starts[flat] + position  # each assignment's row in the groups
        index = torch.arange(assignments, device=x.device)
        placed = row if keep is None else torch.where(keep, row, rows + index)  # (dropped: past the buffer)
        out = self.experts(place_rows(x, index // self.top_k, placed, rows), offs)
        if keep is None:
            return out[row]
        return out[torch.where(keep, row, 0)].masked_fill(~keep.unsqueeze(-1), 0)

    def parallel_experts(self, x: torch.Tensor, order: torch.Tensor, keep: torch.Tensor | None,
                         kept: torch.Tensor) -> torch.Tensor:
        """`local_experts` under expert parallelism (`self.dispatcher`): the kept assignments' rows,
        sorted by expert, go to the ranks holding their experts and back. This path syncs with the
        host: all_to_all_single takes its uneven split sizes as host integers (EPDispatcher reads
        them once per layer, as torchtitan's does), and the capacity drop is a boolean index."""
        assignments = order.shape[0]
        if keep is not None:
            order = order[keep[order]]
        out_rows = self.dispatcher(x[order // self.top_k], kept, self.experts.sorted_rows)
        return out_rows.new_zeros((assignments, out_rows.shape[1])).index_copy(0, order, out_rows)

    def balance(self, y: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, assigned: torch.Tensor,
                dropped: torch.Tensor, tokens: int, seq_counts: torch.Tensor | None = None) -> torch.Tensor:
        """Global statistics of this micro-batch (one all-reduce over the ranks that split the data;
        `assigned`: the assignments per expert, before any capacity drop; `seq_counts`: per sequence,
        `sequence_counts`), the aux / z / sequence-wise losses' gradients attached to `y`, the step's
        statistics updated (on the device: read at log lines)."""
        m, E = self.cfg, self.num_experts
        probs = scores if m.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        prob_sum = probs.sum(0)  # (E,) differentiable
        lse_sq = torch.logsumexp(logits, -1).pow(2).sum() if m.z_loss_coef else logits.new_zeros(())
        seq_term = self.sequence_term(probs, seq_counts)
        summary = torch.cat([assigned.float(), prob_sum.detach(), lse_sq.detach().view(1),
                             torch.full((1,), float(tokens), device=logits.device), dropped.view(1),
                             seq_term.detach().view(1)])
        recompute = torch._C._current_graph_task_id() != -1  # (activation checkpointing's re-run in backward)
        if self.token_group is not None:
            import torch.distributed as dist

            dist.all_reduce(summary, group=self.token_group)
        g_assigned, g_prob, g_lse, g_tokens, g_dropped, g_seq = (
            summary[:E], summary[E:2 * E], summary[2 * E], summary[2 * E + 1], summary[2 * E + 2], summary[2 * E + 3])
        f = g_assigned / (g_tokens * self.top_k)
        aux_local = E * (f * prob_sum).sum() / g_tokens  # this rank's share: the ranks' shares add up
        z_local = lse_sq / g_tokens
        seq_local = seq_term / g_tokens  # (likewise: the mean over the global micro-batch's sequences)
        if not recompute:
            aux_global = E * (f * g_prob).sum() / g_tokens
            self._record(torch.cat([g_assigned, torch.stack([g_tokens, g_dropped, aux_global, g_lse / g_tokens,
                                                             g_seq / g_tokens])]))
        loss = m.aux_loss_coef * aux_local + m.z_loss_coef * z_local + m.seq_aux_loss_coef * seq_local
        if loss.requires_grad and (m.aux_loss_coef or m.z_loss_coef or m.seq_aux_loss_coef):
            y = AuxLossGrad.apply(y, loss, self.aux_grad_scale)
        return y

    def sequence_term(self, probs: torch.Tensor, seq_counts: torch.Tensor | None) -> torch.Tensor:
        """This rank's part of sum over sequences s and experts i of E / (k T) c_{s,i} p_{s,i} (fp32 scalar,
        differentiable), with c the sequence's assignments (all its tokens: `sequence_counts`), p the
        sum of normalised scores over this rank's tokens of it, T the tokens of a whole sequence; over
        all ranks, / the global token count, it is the mean over sequences of sum_i f_{s,i} P_{s,i}:
        T / global tokens = 1 / sequences, and f P = E c / (k T) x p / T. Zero when the loss is off."""
        if seq_counts is None:
            return probs.new_zeros(())
        seqs = seq_counts.shape[0]
        seq_tokens = seq_counts[0].sum() / self.top_k  # (every sequence has the same length: T)
        p = probs.view(seqs, -1, self.num_experts).sum(1)  # (seqs, E)
        return self.num_experts * (seq_counts * p).sum() / (self.top_k * seq_tokens)

    def _record(self, values: torch.Tensor) -> None:
        if self.stats is None:
            self.stats = MoEStats(torch.zeros_like(values, dtype=torch.float64))
        self.stats.acc += values.detach()
        self.stats.micro_batches += 1

    @torch.no_grad()
    def take_stats(self) -> MoEStats | None:
        """The step's statistics (and reset), after applying the auxiliary-loss-free bias update
        (model.moe.bias_update_rate): the same on every rank, from the global counts."""
        s, self.stats = self.stats, None
        if s is not None:
            self.update_bias(s)
        return s

    @torch.no_grad()
    def update_bias(self, stats: MoEStats) -> None:
        """The auxiliary-loss-free bias update of a step's statistics `stats` (nothing unless
        model.moe.bias_update_rate)."""
        if self.cfg.bias_update_rate:
            load = stats.acc[:-5].to(torch.float32)
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)


def is_moe(module: nn.Module) -> bool:
    return isinstance(module, MoE)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The MoE feed-forwards of `model` (a Transformer, a pipeline stage, a block; wrapped or not) by
    block index."""
    return dict(sorted((m.layer, m) for m in model.modules() if isinstance(m, MoE)))

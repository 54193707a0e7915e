"""Mixture-of-Experts feed-forward (`model.moe.*`): a router, routed SwiGLU experts computed with one
grouped GEMM per projection, optional shared experts, load-balancing losses and statistics.

    block.mlp = MoE(cfg)      # Transformer builds it for the blocks `cfg.moe.is_moe_layer(i)` names

One forward, for the T tokens of a micro-batch on this rank (x flattened to (T, dim)):

1. **Route.** Router logits (fp32) -> scores: softmax over the experts (Mixtral, Qwen3-MoE) or a
   sigmoid per expert (DeepSeek-V3). The top-k experts of each token are chosen on scores + the
   selection bias (`expert_bias`, a persistent buffer: zero unless the auxiliary-loss-free update
   moves it), the weights are the chosen *scores* (renormalised to sum 1 when
   model.moe.renormalize, times model.moe.route_scale).
2. **Sort.** The T x k (token, expert) assignments are sorted by expert (a stable argsort: within
   an expert, token order); with a capacity factor the assignments past an expert's capacity are
   dropped here (counted). The token rows are gathered in that order.
3. **Experts.** One `torch._grouped_mm` per projection (gate, up, down) over the sorted rows with
   the experts' cumulative counts as offsets: no Python loop over experts. Where the grouped GEMM
   is unavailable or the shapes break its 16-byte stride rule, a padded batched matmul
   (`torch.bmm` over (experts, most tokens of one expert, dim)) gives the same numbers. Under expert
   parallelism (lmforge.parallel.expert_parallel) this step is wrapped in an all-to-all dispatch to
   the ranks that hold the experts and an all-to-all combine back (`self.dispatcher`).
4. **Combine.** Each assignment's output goes back to its (token, slot) place and the k slots are
   summed with their weights (a fixed order: the result does not depend on where experts ran);
   shared experts (one SwiGLU of shared_experts x expert_hidden) are added.

Balancing: the auxiliary loss E * sum_i f_i P_i (f_i: share of assignments to expert i, P_i: mean
router probability) and the z-loss mean(logsumexp(logits)^2) are computed over the micro-batch's
tokens of *all* ranks that split the data (one all-reduce of 2E + 2 numbers per layer: `token_group`),
so every layout optimises the same objective as one process. They enter backward through
`AuxLossGrad` (Megatron's MoEAuxLossAutoScaler idea): the layer's output is unchanged, and its
backward adds the loss's gradient, scaled by `aux_grad_scale` (set by the layout per step: the
data-parallel averaging and the micro-batch count), so no training loop needs to know about it.
The reported training loss stays the language-model loss; the aux losses go to the metrics.

The per-step statistics (`MoEStats`: tokens per expert, dropped assignments, aux and z losses,
summed over the step's micro-batches) feed the auxiliary-loss-free bias update (DeepSeek-V3:
b_i += rate * sign(mean load - load_i) after each step, the same on every rank since the counts are
global) and the metrics (lmforge.parallel.expert_parallel.moe_step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.layers import SwiGLU

# experts' grouped GEMM: rows sorted by expert, counts per expert -> output rows
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def expert_hidden(cfg: ModelConfig) -> int:
    return cfg.moe.expert_hidden or cfg.ffn_dim


# ---- grouped GEMM ---------------------------------------------------------------------------------


def grouped_mm_ok(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs (x (M, K) @ w (G, K, N)) here: the op exists and the row
    strides are multiples of 16 bytes (its rule on CPU and CUDA). On CUDA (bf16, Hopper or newer)
    also every group's row count a multiple of 16, so the backward's x^T @ grad, whose groups run
    along the rows, starts each group 16-byte aligned (torchtitan pads groups for the same reason);
    lmforge does not pad yet, so other loads take the padded bmm. (CPU runs were measured; the CUDA
    rule is conservative and not yet run on a GPU.)"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu" and x.dtype not in (torch.float32, torch.bfloat16):
        return False
    size = x.element_size()
    if (x.shape[1] * size) % 16 or (w.shape[2] * size) % 16:
        return False
    if x.device.type == "cuda":
        return (x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
                and bool((counts % 16 == 0).all()))
    return True


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (_grouped_mm's backward
    refuses the stride-0 gradients of e.g. `.sum()`)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, mode: str = "auto") -> torch.Tensor:
    """Rows of `x` (M, K) sorted by group, `counts[g]` rows for group g, each times its own `w[g]`
    (K, N) -> (M, N). One `torch._grouped_mm` (mode 'auto' where it runs, 'on' always), else one
    padded batched matmul; never a Python loop over the groups."""
    w = w.to(x.dtype)
    if mode == "on" or (mode == "auto" and grouped_mm_ok(x, w, counts)):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offs))
    return padded_bmm(x, w, counts)


def padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The fallback of `grouped_matmul`: scatter the rows into (G, most rows of a group, K) with zero
    padding, one `torch.bmm`, gather the real rows back."""
    groups, m = w.shape[0], x.shape[0]
    if m == 0:
        return x.new_zeros((0, w.shape[2]))
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts, output_size=m)
    slot = torch.arange(m, device=x.device) - starts[group]
    width = int(counts.max())
    padded = x.new_zeros((groups, width, x.shape[1]))
    padded[group, slot] = x
    return torch.bmm(padded, w)[group, slot]


def experts_loop(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    """Reference (and the benchmark's baseline): the SwiGLU experts one at a time, a Python loop over
    the groups of expert-sorted rows."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        outs.append((F.silu(rows @ w_gate[e]) * (rows @ w_up[e])) @ w_down[e])
        start += n
    return torch.cat(outs) if outs else x.new_zeros((0, w_down.shape[-1]))


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

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by (local) expert, `counts` rows per expert -> the experts' outputs, same order."""
        w_gate, w_up, w_down = self.local_weights()
        assert counts.shape[0] == w_gate.shape[0], (counts.shape, w_gate.shape)
        h = F.silu(grouped_matmul(x, w_gate, counts, self.mode)) * grouped_matmul(x, w_up, counts, self.mode)
        return grouped_matmul(h, w_down, counts, self.mode)


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
    the (token, expert) assignments, then tokens, dropped assignments, aux loss and z-loss, each
    summed over the micro-batches."""

    acc: torch.Tensor
    micro_batches: int = 0

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.acc[:-4].cpu()

    @property
    def tokens(self) -> int:
        return int(self.acc[-4])

    @property
    def dropped(self) -> int:
        return int(self.acc[-3])

    @property
    def aux_loss(self) -> float:
        """Mean over the step's micro-batches."""
        return float(self.acc[-2]) / max(self.micro_batches, 1)

    @property
    def z_loss(self) -> float:
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
        _, chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        weights = scores.gather(1, chosen)
        if m.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, chosen, weights * m.route_scale

    def keep_mask(self, sorted_experts: torch.Tensor, counts: torch.Tensor, tokens: int) -> torch.Tensor | None:
        """Capacity factor: which of the expert-sorted assignments fit their expert's capacity (the
        first ones in token order); None when dropless."""
        if not self.cfg.capacity_factor:
            return None
        capacity = math.ceil(self.cfg.capacity_factor * tokens * self.top_k / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(sorted_experts.shape[0], device=sorted_experts.device) - starts[sorted_experts]
        return position < capacity

    # ---- forward -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        logits, scores, chosen, weights = self.route(x)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments by expert, token order within one
        counts = torch.bincount(flat, minlength=self.num_experts)
        keep = self.keep_mask(flat[order], counts, tokens)
        dropped = torch.zeros((), device=x.device)
        if keep is not None:
            dropped = (~keep).sum().float()
            order = order[keep]
            counts = torch.bincount(flat[order], minlength=self.num_experts)
        rows = x[order // self.top_k]
        if self.dispatcher is not None:
            out_rows = self.dispatcher(rows, counts, self.experts)
        else:
            out_rows = self.experts(rows, counts)
        slots = x.new_zeros((tokens * self.top_k, shape[-1])).index_copy(0, order, out_rows)
        y = (slots.view(tokens, self.top_k, -1) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training and torch.is_grad_enabled():
            y = self.balance(y, logits, scores, chosen, counts, dropped, tokens)
        return y.view(shape)

    def balance(self, y: torch.Tensor, logits: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
                counts: torch.Tensor, dropped: torch.Tensor, tokens: int) -> torch.Tensor:
        """Global statistics of this micro-batch (one all-reduce over the ranks that split the data),
        the aux / z losses' gradients attached to `y`, the step's statistics updated."""
        m, E = self.cfg, self.num_experts
        probs = scores if m.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        prob_sum = probs.sum(0)  # (E,) differentiable
        lse_sq = torch.logsumexp(logits, -1).pow(2).sum() if m.z_loss_coef else logits.new_zeros(())
        assigned = torch.bincount(chosen.reshape(-1), minlength=E)
        summary = torch.cat([assigned.float(), prob_sum.detach(), lse_sq.detach().view(1),
                             torch.full((1,), float(tokens), device=logits.device), dropped.view(1)])
        recompute = torch._C._current_graph_task_id() != -1  # (activation checkpointing's re-run in backward)
        if self.token_group is not None:
            import torch.distributed as dist

            dist.all_reduce(summary, group=self.token_group)
        g_assigned, g_prob, g_lse, g_tokens, g_dropped = (summary[:E], summary[E:2 * E], summary[2 * E],
                                                          summary[2 * E + 1], summary[2 * E + 2])
        f = g_assigned / (g_tokens * self.top_k)
        aux_local = E * (f * prob_sum).sum() / g_tokens  # this rank's share: the ranks' shares add up
        z_local = lse_sq / g_tokens
        if not recompute:
            aux_global = E * (f * g_prob).sum() / g_tokens
            self._record(torch.cat([g_assigned, torch.stack([g_tokens, g_dropped, aux_global, g_lse / g_tokens])]))
        loss = m.aux_loss_coef * aux_local + m.z_loss_coef * z_local
        if loss.requires_grad and (m.aux_loss_coef or m.z_loss_coef):
            y = AuxLossGrad.apply(y, loss, self.aux_grad_scale)
        return y

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
        if s is not None and self.cfg.bias_update_rate:
            load = s.acc[:-4].to(torch.float32)
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(load.mean() - load)
        return s


def is_moe(module: nn.Module) -> bool:
    return isinstance(module, MoE)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The MoE feed-forwards of `model` (a Transformer, a pipeline stage, a block; wrapped or not) by
    block index."""
    return dict(sorted((m.layer, m) for m in model.modules() if isinstance(m, MoE)))

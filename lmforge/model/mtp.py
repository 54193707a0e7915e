"""Multi-token prediction (MTP; DeepSeek-V3 arXiv 2412.19437 section 2.2), `model.mtp_depth` = D > 0.

D modules after the main model, sequential (each keeps the causal chain of the one before), sharing
the main model's embedding and output head. For a sequence of T tokens t_1 .. t_T (the main model
predicts t_{i+1} at position i from its final hidden state h^0_i, before the final norm), depth
k = 1 .. D at position i:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      (2 dim -> dim: `proj`, `emb_norm`, `hidden_norm`)
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                              (one transformer block: `block`)
    P^k_{i+k+1} = OutHead(RMSNorm(h^k_i))                          (`norm`, then the shared head)
    L^k = -(1/T) sum_i log P^k_{i+k+1}[t_{i+k+1}]                 (over the T - k positions with a target)

    objective = L_main + lambda / D * sum_k L^k                  (lambda: model.mtp_loss_weight)

The concatenation puts the embedding first: the paper writes [h; Emb], but DeepSeek's released
checkpoints (`eh_proj`) and transformers' MtpLayer take [enorm(Emb); hnorm(h)], and lmforge's `proj`
keeps their column order so the weights map one to one (lmforge.interop.hf_deepseek). Depth k + 1
takes h^k, the block's output before its final norm (the paper's h^k; transformers' drafting loop
passes the normed one, the same for D = 1, DeepSeek-V3's depth). Block k is the block the main
model would have at index n_layers + k - 1 (an MoE feed-forward where model.moe makes that one MoE:
DeepSeek-V3's MTP block is an MoE block); its attention is the model's (multi-head latent attention
under model.mla).

Lengths. lmforge's batches are (x, y) with y the next tokens of x (x_i = t_i, y_i = t_{i+1}, T
positions). Depth k reads the embeddings of x shifted left by k (x_{i+k}) and predicts y_{i+k}; the
last k positions have no input token nor target: their inputs are token 0 and their targets ignored
(-100), and as they come after every real position the causal attention keeps them out of the
others. Every depth's NLL is summed over its targets and normalised, like the main loss, by the
step's target count (the paper's 1/T), so the objective is (nll_main + lambda / D sum_k nll_k) / N.

The training loop is unchanged: the language-model NLL is what the forward returns and what the
metrics call the loss; the MTP losses enter backward only (`_WithExtraLoss`: the returned value is
the main NLL, its backward also sends the incoming gradient to the MTP term). Each depth's summed
NLL and target count accumulate over the step on the device (`MTP.stats`, read by the layout at
log lines: mtp_loss_1 .. mtp_loss_D, each the mean NLL per target of its depth over the step's
global batch). Evaluation and generation (not training, or no gradient) skip the modules entirely.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.layers import make_norm
from lmforge.model.loss import IGNORE_INDEX


class MTPModule(nn.Module):
    """One depth: the two norms, the projection, a transformer block and its final norm."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.emb_norm = make_norm(cfg)
        self.hidden_norm = make_norm(cfg)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = make_norm(cfg)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, rope) -> torch.Tensor:
        """Embeddings of the tokens k ahead and the previous depth's hidden states -> this depth's."""
        x = self.proj(torch.cat((self.emb_norm(emb), self.hidden_norm(h)), dim=-1))
        return self.block(x.to(h.dtype), rope)  # (the residual stream in its dtype: fp32 under autocast)


class _WithExtraLoss(torch.autograd.Function):
    """Identity on `main` (a scalar) whose backward also gives `extra` the incoming gradient: the
    objective main + extra, the value main."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return main.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, g


def shifted(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(batch, seq) -> t shifted left by k along the sequence, the last k positions `fill`."""
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)


class MTP(nn.ModuleDict):
    """The D modules, keyed "0" .. "D-1" (parameter names mtp.<k-1>.*), and their training loss."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[ModelConfig, int], nn.Module]):
        super().__init__({str(k): MTPModule(cfg, make_block(cfg, cfg.n_layers + k)) for k in range(cfg.mtp_depth)})
        self.weight = cfg.mtp_loss_weight
        self.stats: torch.Tensor | None = None  # (D, 2) float64: each depth's summed NLL and target count

    def loss(self, h: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor, rope,
             embed: Callable[[torch.Tensor], torch.Tensor],
             head_nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """lambda / D x the depths' summed NLLs (fp32 scalar), from the main model's final hidden states h
        (before its norm); `embed` the shared embedding, `head_nll(normed hidden, targets)` the shared
        head's summed NLL. The step's statistics are updated on the device."""
        nlls, counts = [], []
        for k, module in enumerate(self.values(), start=1):
            h = module(embed(shifted(tokens, k, 0)), h, rope)
            y = shifted(targets, k, IGNORE_INDEX)
            nlls.append(head_nll(module.norm(h), y))
            counts.append((y != IGNORE_INDEX).sum())
        nll = torch.stack(nlls)
        value = nll.detach()
        if hasattr(value, "full_tensor"):  # (tensor parallelism: loss_parallel's replicated DTensor)
            value = value.full_tensor()
        step = torch.stack((value.double(), torch.stack(counts).double()), dim=1)
        self.stats = step if self.stats is None else self.stats + step
        return nll.sum() * (self.weight / len(self))

    def take_stats(self) -> torch.Tensor | None:
        """The step's (D, 2) statistics (summed NLL, targets per depth; this rank's) and reset."""
        stats, self.stats = self.stats, None
        return stats


def with_mtp_loss(main_nll: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
    """main_nll's value, backward through main_nll + mtp_loss."""
    return _WithExtraLoss.apply(main_nll, mtp_loss)


def mtp_metrics(stats: torch.Tensor) -> dict[str, float]:
    """mtp_loss_1 .. mtp_loss_D (each depth's mean NLL per target) of a step's statistics summed over
    the data-parallel ranks (a host read: at log lines)."""
    values = stats.tolist()
    return {f"mtp_loss_{k}": nll / count if count else float("nan") for k, (nll, count) in enumerate(values, start=1)}


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `model`'s MTP modules (none without them), for the layouts that treat
    every block alike (FSDP2 units)."""
    mtp = getattr(model, "mtp", None)
    return [depth.block for depth in mtp.values()] if mtp is not None else []


def take_mtp_stats(model: nn.Module) -> torch.Tensor | None:
    """The step's MTP statistics of `model` (a Transformer, wrapped or not), or None without MTP."""
    for m in model.modules():
        if isinstance(m, MTP):
            return m.take_stats()
    return None

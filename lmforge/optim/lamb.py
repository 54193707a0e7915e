"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

Hand-written because torch.optim has no LAMB. Per parameter tensor (a "layer"), at step t:

    m = beta1 * m + (1 - beta1) * g             v = beta2 * v + (1 - beta2) * g^2
    m_hat = m / (1 - beta1^t)                   v_hat = v / (1 - beta2^t)
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
    trust = ||p|| / ||r||   (1 when either norm is 0)
    p = p - lr * trust * r
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from lmforge.optim._common import check_betas, check_non_negative, evaluate_closure, grad_of
from lmforge.optim.optimizers import betas, groups

if TYPE_CHECKING:
    from lmforge.config import OptimConfig


class LAMB(torch.optim.Optimizer):
    """Adam moments with a layer-wise trust ratio; state: `step` (int), `exp_avg`, `exp_avg_sq`."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay)
        check_betas(betas)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One LAMB update for every parameter that has a gradient."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = grad_of(p, "LAMB")
                if g is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
                r = (m / (1.0 - beta1**t)).div_(denom)
                if wd != 0:
                    r.add_(p, alpha=wd)
                # Trust ratio as a 0-d tensor: no host sync on GPU.
                w_norm, r_norm = p.norm(), r.norm()
                trust = torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))
                p.add_(r.mul_(trust), alpha=-lr)
        return loss


def build(model: torch.nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> LAMB:
    """The registry's builder (lmforge.spec.optimizers)."""
    return LAMB(groups(model, cfg), lr=cfg.lr, betas=betas(cfg), eps=cfg.eps)

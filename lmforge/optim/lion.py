"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Hand-written because torch.optim has no Lion. Per parameter, with one state tensor m:

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p - lr * (update + weight_decay * p)
    m      = beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from lmforge.optim._common import check_betas, check_non_negative, evaluate_closure, grad_of
from lmforge.optim.optimizers import betas, groups

if TYPE_CHECKING:
    from lmforge.config import OptimConfig


class Lion(torch.optim.Optimizer):
    """Sign-momentum optimizer: one state tensor (`exp_avg`) per parameter, decoupled weight decay.

    Lion's updates have unit magnitude per element, so its lr is typically 3-10x smaller than
    AdamW's and its weight decay 3-10x larger, keeping lr * weight_decay similar.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        check_non_negative(lr=lr, weight_decay=weight_decay)
        check_betas(betas)
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Lion update for every parameter that has a gradient."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                g = grad_of(p, "Lion")
                if g is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                update = torch.lerp(m, g, 1.0 - beta1).sign_()
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                p.add_(update, alpha=-lr)
                m.lerp_(g, 1.0 - beta2)
        return loss


def build(model: torch.nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> Lion:
    """The registry's builder (lmforge.spec.optimizers)."""
    return Lion(groups(model, cfg), lr=cfg.lr, betas=betas(cfg))

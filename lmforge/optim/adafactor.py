"""torch.optim.Adafactor, usable on DTensor parameters (FSDP2 / tensor parallel).

torch's Adafactor squares the row/column norms in place (`torch.norm(g, dim=-2).square_()`).
On a sharded DTensor that norm is a pending reduction (a `_NormPartial` placement) and DTensor
refuses in-place ops that would have to change the placement, so FSDP2 and TP runs crashed on
their first step. For DTensor parameters this class runs the same single-tensor update with
out-of-place ops, which DTensor redistributes as needed (one all-reduce per factored norm); plain
tensors keep torch's own code path, so single-process runs are torch's Adafactor bit for bit.

The state (`step`, `row_var`, `col_var`, `variance`) and hyperparameters are torch's, so
checkpoints are interchangeable with torch.optim.Adafactor's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from lmforge.optim.optimizers import groups

if TYPE_CHECKING:
    from lmforge.config import OptimConfig


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose update also runs on DTensor parameters."""

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            row_vars: list[torch.Tensor | None] = []
            col_vars: list[torch.Tensor | None] = []
            variances: list[torch.Tensor | None] = []
            steps: list[torch.Tensor] = []
            self._init_group(group, params, grads, row_vars, col_vars, variances, steps)
            for args in zip(params, grads, row_vars, col_vars, variances, steps, strict=True):
                _update(*args, group)
        return loss


def _update(
    param: torch.Tensor, grad: torch.Tensor, row_var: torch.Tensor | None, col_var: torch.Tensor | None,
    variance: torch.Tensor | None, step_t: torch.Tensor, group: dict[str, Any],
) -> None:
    """torch's `_single_tensor_adafactor` for one parameter, with out-of-place reductions."""
    lr, d, weight_decay = float(group["lr"]), group["d"], group["weight_decay"]
    eps1, eps2 = group["eps"]
    if eps1 is None:
        eps1 = torch.finfo(param.dtype).eps
    if group["maximize"]:
        grad = -grad
    step_t += 1
    step = step_t.item()
    one_minus_beta2_t = step ** group["beta2_decay"]
    rho_t = min(lr, 1 / (step**0.5))
    alpha = max(eps2, _item(param.norm(2)) / (param.numel() ** 0.5)) * rho_t
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        assert row_var is not None and col_var is not None
        row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square().div(grad.size(-1)), one_minus_beta2_t)
        col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square().div(grad.size(-2)), one_minus_beta2_t)
        var_estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
    else:
        assert variance is not None
        variance.lerp_(grad * grad, one_minus_beta2_t)
        var_estimate = variance.clone()
    update = var_estimate.clamp(min=eps1 * eps1).rsqrt().mul(grad)
    denom = max(1.0, _item(update.norm(2)) / ((update.numel() ** 0.5) * d))
    param.add_(update, alpha=-alpha / denom)


def _item(x: torch.Tensor) -> float:
    """A 0-d tensor's value; a DTensor's pending (partial) reduction is completed first (`.item()` on
    a DTensor norm would return this rank's partial norm)."""
    return (x.full_tensor() if isinstance(x, DTensor) else x).item()


def build(model: torch.nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> Adafactor:
    """The registry's builder (lmforge.spec.optimizers); extra: beta2_decay, clip_threshold, adafactor_eps."""
    for unsupported in ("beta1", "relative_step", "scale_parameter"):
        if unsupported in extra:
            raise ValueError(
                f"adafactor option {unsupported!r} is not supported: lmforge uses torch.optim.Adafactor, "
                "which always uses the relative step and parameter scaling and keeps no first moment; "
                "drop the option or pick another optimizer (e.g. adamw)")
    return Adafactor(groups(model, cfg), lr=cfg.lr, beta2_decay=extra.pop("beta2_decay", -0.8),
                     d=extra.pop("clip_threshold", 1.0), eps=tuple(extra.pop("adafactor_eps", (None, 1e-3))))

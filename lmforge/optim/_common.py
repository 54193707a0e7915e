"""Small helpers shared by the hand-written optimizers."""

from __future__ import annotations

from collections.abc import Callable

import torch


def evaluate_closure(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """Run `closure` with grad enabled (step() itself runs under no_grad), as torch optimizers do."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def grad_of(p: torch.Tensor, optimizer_name: str) -> torch.Tensor | None:
    """The dense gradient of `p`, or None when it has none (the parameter is skipped)."""
    if p.grad is None:
        return None
    if p.grad.is_sparse:
        raise ValueError(f"{optimizer_name} does not support sparse gradients; use a dense embedding")
    return p.grad


def check_betas(betas: tuple[float, float]) -> None:
    """Betas must be in [0, 1)."""
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}]={b} must be in [0, 1)")


def check_non_negative(**values: float) -> None:
    """Every value (lr, weight_decay, eps, ...) must be >= 0."""
    for key, value in values.items():
        if value < 0:
            raise ValueError(f"{key}={value} must be >= 0")

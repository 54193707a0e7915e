"""Validation loss and perplexity over held-out batches."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], autocast,
                  device: torch.device) -> dict[str, float]:
    """Token-weighted mean cross-entropy (nats) over `batches`, and its exp (perplexity).

    Targets equal to -100 are ignored, and every token counts once however batches are sized.
    """
    was_training = model.training
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    total_tokens = 0
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            logits = model(x)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        total_nll += nll.double()
        total_tokens += int((y != -100).sum())
    model.train(was_training)
    if total_tokens == 0:
        raise ValueError("validation set produced no tokens; raise data.val_fraction or lower train.eval_batches.")
    loss = float(total_nll) / total_tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": total_tokens}

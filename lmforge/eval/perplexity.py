"""Validation loss and perplexity: over held-out batches, and over a long token stream with a
sliding window."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from lmforge.model.documents import DocumentAttention, document_inputs
from lmforge.model.loss import IGNORE_INDEX, count_targets, model_nll_sum


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], autocast,
                  device: torch.device, loss_chunk: int = 0, documents: DocumentAttention | None = None
                  ) -> dict[str, float]:
    """Token-weighted mean cross-entropy (nats) over `batches`, and its exp (perplexity).

    Targets equal to -100 are ignored, and every token counts once however batches are sized.
    `loss_chunk` > 0 (train.loss_chunk as the layout runs it): the model's forward takes the targets
    and computes the loss over that many tokens at a time (lmforge.model.loss), so the micro-batch's
    [B, T, vocab] logits never exist (they would be the evaluation's largest buffers); 0: the plain
    logits (a model that takes no targets: tensor- and pipeline-parallel inference). `documents`
    (data.attention = "document"): attention within each document, as in training.
    """
    was_training = model.training
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64, device=device)
    total_tokens = 0
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total_nll += model_nll_sum(model, x, y, loss_chunk, autocast, **document_inputs(documents, x)).double()
        total_tokens += int(count_targets(y))
    model.train(was_training)
    if total_tokens == 0:
        raise ValueError("validation set produced no tokens; raise data.val_fraction or raise train.eval_sequences.")
    return perplexity_report(float(total_nll), total_tokens)


@torch.no_grad()
def sliding_window_nll(model: torch.nn.Module, tokens, window: int, stride: int, batch_size: int = 8,
                       device: torch.device | str = "cpu", loss_chunk: int = 0,
                       documents: DocumentAttention | None = None) -> tuple[float, int]:
    """(summed NLL in nats, number of scored tokens) of a token stream under a sliding window.

    Token 0 has no context and is not scored; every later token is scored exactly once. A
    window of `window` input tokens starts every `stride` tokens; it scores only the targets the
    previous window did not, so after the first window each token is predicted from at least
    `window - stride` tokens of context (stride = window: disjoint windows, the fastest and the
    least context). When the stream fits in one window, this is the plain full-context NLL.
    `loss_chunk` > 0: the model's forward computes the loss over that many tokens at a time
    (lmforge.model.loss; as `evaluate_loss`), so a batch's [B, window, vocab] logits never exist.
    `documents` (a run trained with data.attention = "document"): each window attends within its
    documents, as the model trained.
    """
    if window < 1 or not 1 <= stride <= window:
        raise ValueError(f"window = {window} and stride = {stride} must satisfy 1 <= stride <= window.")
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n = tokens.numel()
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}.")
    windows: list[tuple[int, int, int]] = []  # (begin, end, targets already scored before this window)
    begin, scored = 0, 0  # `scored`: targets 1..scored done
    while scored < n - 1:
        end = min(begin + window, n - 1)
        windows.append((begin, end, scored))
        scored, begin = end, begin + stride
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for lo in range(0, len(windows), batch_size):
        group = windows[lo:lo + batch_size]
        width = max(e - b for b, e, _ in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        y = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
        for row, (b, e, done) in enumerate(group):
            x[row, :e - b] = tokens[b:e]
            y[row, :e - b] = tokens[b + 1:e + 1]
            y[row, :done - b] = IGNORE_INDEX  # targets b+1..done were scored by an earlier window
        x, y = x.to(device), y.to(device)
        total += model_nll_sum(model, x, y, loss_chunk, **document_inputs(documents, x)).double().cpu()
        count += int(count_targets(y))
    model.train(was_training)
    assert count == n - 1, (count, n)
    return float(total), count


def perplexity_report(nll_sum: float, count: int) -> dict[str, float]:
    """Mean NLL per scored token and its exp."""
    loss = nll_sum / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}

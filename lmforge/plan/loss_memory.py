"""The output head and the cross-entropy's memory (lmforge convention): what the loss keeps for
backward and its transient peak, with plain logits or the chunked loss (lmforge.plan.memory's
docstring: "The output head and the loss")."""

from __future__ import annotations

from lmforge.config import ModelConfig
from lmforge.plan.layout import Layout


def lmforge_loss_bytes(cfg: ModelConfig, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(kept, transient): bytes of the last stage's output head + cross-entropy for one micro-batch
    (lmforge convention): what it keeps for backward, and what it allocates on top of that at its
    worst moment (a peak of the step, counted once as the buffer `loss_transient`, whatever the
    micro-batches in flight). n = b s / cp tokens, V the vocabulary (/ t under TP), d the model
    width, c the chunk, `half` the compute dtype's bytes (4 in fp32 runs). Module docstring:
    "The output head and the loss"."""
    n = (seq_len // layout.cp) * layout.micro_batch
    V, d, t = cfg.vocab_size, cfg.dim, layout.tp
    half = 4 if layout.precision == "fp32" else 2
    if not layout.loss_chunk:
        # kept: the fp32 log-softmax; backward: nll_loss's dense fp32 gradient of it and log_softmax's
        # fp32 gradient of the logits, both alive with the kept one (more than the forward's 16-bit
        # logits + fp32 copy)
        return 4 * n * V / t, 8 * n * V / t
    c = min(layout.loss_chunk, n)
    kept = 4 * n * d + 4 * V * d  # grad_hidden (the fp32 norm output's size) and the fp32 grad_weight
    cast = half * d if half == 2 else 0  # a chunk's hidden rows in the compute dtype (fp32: a view)
    moments = [c * (2 * half * V + cast)]  # a chunk: its logits + its gradient (softmax - one_hot)
    if half == 2:
        # g.T @ hidden in 16 bits before it is added into the fp32 grad_weight; and in backward the
        # weight gradient returned in 16 bits (the head's 16-bit copy) beside its fp32 cast
        moments += [c * (half * V + cast + half * d) + half * V * d, 2 * V * d]
    return kept, max(moments)

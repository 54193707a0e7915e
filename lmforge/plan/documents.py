"""What the document mask (data.attention = "document": lmforge.model.documents) costs a step, by
its kernel (`Layout.documents`, as `lmforge.plan.layout.planned_documents` resolves it).

Memory, per micro-batch of B sequences of T tokens in flight on a rank (CP: its two chunks of c = T /
(2 cp) queries over the c (chunk + 1) keys up to each, (2 cp + 1) c^2 query-key pairs in all, `pairs`):

- ``sdpa``: the boolean mask, built once per forward and read by every block (B x pairs bytes), and,
  per block that keeps its attention's inputs for backward (not recomputed by full activation
  checkpointing), SDPA's own copy of it: SDPA turns a boolean mask into an additive one in the query's
  dtype and saves that for backward (a x B x pairs bytes a layer, a the attention dtype's bytes:
  measured with saved-tensor hooks in tests/test_plan_documents.py).
- ``flex``: the block mask, created from the document ids without a dense mask: the kv and q (for
  the backward) block indices and counts of partial and full blocks, four int32 tensors of (B,
  query blocks, key blocks) per chunk (block 128 tokens); a few KiB to MiB, next to nothing.
- both: the document ids, int32 (B x T: whole sequences, every rank of a CP group holds them).

Time, against the causal kernels the planner's attention rate is fitted on (lmforge.plan.op_time):

- ``sdpa``: the masked kernel computes every query-key pair of its [T, T] tile grid (a mask of any
  shape: no causal block skipping), twice the causal kernels' work; plus the elementwise passes of
  the additive mask: written once and read in forward and backward per layer (1 + 3a bytes a pair).
- ``flex``: FlexAttention skips the blocks the mask empties: of the causal work it keeps the pairs
  inside documents, about (L + 128) / T of it for documents of L tokens on average (L T / 2 pairs
  within documents against T^2 / 2 causal ones, plus a partial block at each document's edge),
  taken at the causal kernels' rate; L from the prepared corpus' manifests (`Layout.doc_tokens`; 0 =
  not known: no saving counted). Not calibrated on a GPU: FlexAttention's rate is assumed equal to
  the fused causal kernels'.
"""

from __future__ import annotations

import math
from pathlib import Path

from lmforge.plan.activations import attention_dtype_bytes
from lmforge.plan.layout import Layout

FLEX_BLOCK = 128  # FlexAttention's default block size (torch.nn.attention.flex_attention)


def _chunks(layout: Layout, seq_len: int) -> list[tuple[int, int]]:
    """(queries, keys) of each attention call of one sequence on a rank: the whole sequence, or under
    context parallelism the two chunks of the rank with the most keys (rank 0: chunks 0 and 2cp - 1,
    keys c and T, like every rank's (2cp + 1) c in all). Ulysses attends over whole sequences (for
    1/cp of the heads; the mask has no head dimension): one process's mask."""
    if layout.cp == 1 or layout.cp_mode == "ulysses":
        return [(seq_len, seq_len)]
    c = seq_len // (2 * layout.cp)
    return [(c, c), (c, seq_len)]


def mask_pairs(layout: Layout, seq_len: int) -> int:
    """Query-key pairs of one sequence's mask on a rank (module docstring)."""
    return sum(q * k for q, k in _chunks(layout, seq_len))


def document_mask_bytes(layout: Layout, seq_len: int) -> float:
    """Bytes a micro-batch's document mask and ids hold on a rank while it is in flight (module
    docstring); 0 under causal attention."""
    if layout.documents == "none":
        return 0.0
    b = layout.micro_batch
    ids = 4 * b * seq_len
    if layout.documents == "sdpa":
        return ids + b * mask_pairs(layout, seq_len)
    blocks = sum(math.ceil(q / FLEX_BLOCK) * math.ceil(k / FLEX_BLOCK) for q, k in _chunks(layout, seq_len))
    return ids + 4 * 4 * b * blocks


def document_bias_bytes_per_layer(layout: Layout, seq_len: int) -> float:
    """Bytes SDPA saves for backward per layer beyond causal attention: its additive copy of the mask
    (module docstring); 0 for FlexAttention and causal attention."""
    if layout.documents != "sdpa":
        return 0.0
    return attention_dtype_bytes(layout) * layout.micro_batch * mask_pairs(layout, seq_len)


def attention_work_factor(layout: Layout, seq_len: int) -> float:
    """The document-masked attention kernels' time over the causal kernels' (module docstring)."""
    if layout.documents == "sdpa":
        return 2.0
    if layout.documents == "flex" and layout.doc_tokens:
        return min(1.0, (layout.doc_tokens + FLEX_BLOCK) / seq_len)
    return 1.0


def bias_pass_bytes(layout: Layout, seq_len: int) -> float:
    """Elementwise bytes per layer and micro-batch of SDPA's additive mask (written once, read by the
    forward and the backward kernels: 1 + 3a bytes a pair); 0 otherwise."""
    if layout.documents != "sdpa":
        return 0.0
    return (1 + 3 * attention_dtype_bytes(layout)) * layout.micro_batch * mask_pairs(layout, seq_len)


def prepared_train_dir(cfg) -> Path | None:
    """<data.corpus>/train where data.corpus is a prepared mixture folder (`lmforge prepare`), else None
    (the default corpus, or a folder not prepared yet)."""
    if cfg.data.corpus == "default":
        return None
    from lmforge.folders import MIXTURE

    train = Path(cfg.data.corpus).expanduser() / "train"
    return train if (train / MIXTURE).is_file() else None


def corpus_document_tokens(cfg) -> int:
    """Mean tokens per document of the config's prepared corpus as its mixture draws it (0: not known)."""
    from lmforge.data.mixture import mean_document_tokens

    train = prepared_train_dir(cfg)
    return mean_document_tokens(train) if train is not None else 0

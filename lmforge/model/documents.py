"""Document masking (data.attention = "document"): each token attends only to the earlier tokens of
its own document, in a sequence that packs several documents.

Where documents are. A document ends at its end-of-document token (EOS), which belongs to it; so the
document of token t of a row is the number of EOS tokens before t (`document_ids`). A row that starts
inside a document (concatenated packing) begins with that document's tail; padding (best-fit
packing pads rows with EOS, lmforge.data.packing) is one document per padding token and comes after
every real token, so under the causal mask no real token ever sees it. The ids are computed from the
tokens themselves, by the layout, for every micro-batch of *whole* sequences (before context
parallelism cuts them): they travel into the model as a forward argument (`doc_ids`), and through a
pipeline schedule as a keyword argument that every stage receives (lmforge.parallel.pipeline), so the
mask is exact on every layout, under activation checkpointing's recomputation too.

Positions (data.document_positions): "continue" (default) keeps each row's positions 0 .. T-1 running
across its documents, as Llama 3 trains; "restart" gives every document positions from 0
(`document_positions`). With RoPE and the document mask the two are the same function up to float
rounding: a RoPE attention score depends only on the distance between query and key, and the mask
only lets a token see keys of its own document, whose distances do not change when the document's
positions are shifted. So "continue" is the default: the cheaper one (one slice of the RoPE tables
instead of a gather per token), the Llama 3 recipe. With learned position embeddings (GPT-2) the two
differ, and "restart" gives each document the positions it has at generation, where a prompt starts
at position 0.

Kernels (`document_kernel`, chosen once per run and printed in the run header):

* "flex" (CUDA with Triton, no dropout): FlexAttention with a block mask made from the document ids
  (`create_block_mask`, compiled), run by the compiled `flex_attention`: no dense [T, T] mask exists,
  and blocks of keys wholly outside a query block's document are skipped. FlexAttention has no
  backward on the CPU (torch 2.13), and no dropout.
* "sdpa" (CPU; CUDA without Triton or with dropout): scaled_dot_product_attention with a boolean
  (B, 1, T, T) mask (causal & same document & the sliding window), built once per forward and read by
  every block, exact; B T^2 bytes per micro-batch (per chunk under context parallelism).

Generation with a KV cache treats its prompt as one document (no document mask; plain causal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmforge.config.rules import document_kernel_rule, gpu_compile_blocker

DOCUMENT_KERNELS = ("flex", "sdpa")


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, T) int32: the document index of every token in its row, the number of EOS tokens before
    it (an EOS belongs to the document it ends)."""
    ends = (tokens == eos_id).to(torch.int32)
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: every token's position within its document (0 at each document's first token
    in the row; a document that began in an earlier row counts from the row's start)."""
    T = doc_ids.shape[1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.cummax(torch.where(first, idx, torch.zeros_like(idx)), dim=1).values
    return idx - start


@dataclass(frozen=True)
class DocumentAttention:
    """data.attention = "document" as a run applies it: documents end at `eos_id`; `restart_positions`
    (data.document_positions = "restart") numbers each document's tokens from 0."""

    eos_id: int
    restart_positions: bool = False

    def inputs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's document arguments for whole sequences `tokens` (B, T): `doc_ids`, and
        `positions` where they restart."""
        ids = document_ids(tokens, self.eos_id)
        return {"doc_ids": ids, "positions": document_positions(ids)} if self.restart_positions else {"doc_ids": ids}


def document_inputs(documents: DocumentAttention | None, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """`documents.inputs(tokens)`, or no arguments at all under plain causal attention."""
    return {} if documents is None else documents.inputs(tokens)


def document_kernel(device_type: str, dropout_p: float = 0.0) -> str:
    """The attention kernel of the document mask on this device (module docstring)."""
    # (the GPU is asked only where the rule would take FlexAttention: a CPU-only torch has no CUDA to ask)
    flex_runs = device_type == "cuda" and dropout_p == 0.0 and _flex_available() and \
        gpu_compile_blocker(torch.cuda.get_device_capability()) is None
    return document_kernel_rule(device_type, dropout_p, flex_runs)


def describe_document_attention(documents: DocumentAttention | None, device_type: str, dropout: float,
                                micro_batch: int, seq_len: int, cp: int = 1) -> str:
    """The run header's line about attention: causal, or the document mask and its kernel."""
    if documents is None:
        return "attention: causal over the whole packed sequence (data.attention = 'causal')"
    positions = "restart at each document" if documents.restart_positions else "run on across documents"
    kernel = document_kernel(device_type, dropout)
    if kernel == "flex":
        how = "FlexAttention block mask (compiled), no dense [T, T] mask"
    else:
        c = seq_len // (2 * cp)  # (context parallel: each rank's two chunks see (2 cp + 1) c x c keys in all)
        per_mb = micro_batch * (c * c * (2 * cp + 1) if cp > 1 else seq_len * seq_len)
        why = "the CPU has no FlexAttention backward" if device_type == "cpu" else (
            "dropout > 0" if dropout else "FlexAttention needs Triton here")
        how = (f"SDPA with a dense boolean mask ({per_mb / 2**20:.2f} MiB per micro-batch"
               f"{' and CP rank' if cp > 1 else ''}; {why})")
    return f"attention: within each document (data.attention = 'document', EOS id {documents.eos_id}), " \
           f"positions {positions}; {how}"


# ---- masks ------------------------------------------------------------------------------------------


def dense_document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_start: int, window: int = 0) -> torch.Tensor:
    """Boolean (B, 1, q, k) mask: query i (sequence position q_start + i, document q_ids[:, i]) sees key
    j (position j, document k_ids[:, j]) when j <= q_start + i, both are in one document, and j lies in
    the sliding window (`window` > 0: the query's own position and the window - 1 before it)."""
    q_pos = torch.arange(q_start, q_start + q_ids.shape[1], device=q_ids.device).view(-1, 1)
    k_pos = torch.arange(k_ids.shape[1], device=q_ids.device).view(1, -1)
    allowed = k_pos <= q_pos
    if window:
        allowed = allowed & (k_pos > q_pos - window)
    return (allowed & (q_ids[:, :, None] == k_ids[:, None, :])).unsqueeze(1)


def flex_document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_start: int, window: int = 0):
    """The FlexAttention block mask of `dense_document_mask`'s rule (CUDA: created compiled, so the
    [B, q, k] booleans are never materialised)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        q = q_idx + q_start
        keep = (kv_idx <= q) & (q_ids[b, q_idx] == k_ids[b, kv_idx])
        return keep & (kv_idx > q - window) if window else keep

    B, q_len, k_len = q_ids.shape[0], q_ids.shape[1], k_ids.shape[1]
    return create_block_mask(mask_mod, B, None, q_len, k_len, device=q_ids.device,
                             _compile=q_ids.device.type == "cuda")


def document_mask(q_ids: torch.Tensor, k_ids: torch.Tensor, q_start: int, window: int, dropout_p: float):
    """The mask of queries `q_ids` over keys `k_ids` for this device's kernel (`document_kernel`)."""
    if document_kernel(q_ids.device.type, dropout_p) == "flex":
        return flex_document_mask(q_ids, k_ids, q_start, window)
    return dense_document_mask(q_ids, k_ids, q_start, window)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float) -> torch.Tensor:
    """Attention of q (b, heads, q, d) over k, v (b, kv heads, k, d) under a `document_mask`: a boolean
    tensor (SDPA) or a FlexAttention block mask."""
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    assert dropout_p == 0.0, "FlexAttention has no dropout: document_kernel chooses SDPA then"
    return _flex()(q, k, v, block_mask=mask, enable_gqa=gqa)


@functools.cache
def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _flex():
    """flex_attention as it must be called here: traced as it is inside a compiled region (the blocks
    under train.compile), else through its own compiled function (eager FlexAttention computes the
    full score matrix)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention if torch.compiler.is_compiling() else _compiled_flex()


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)

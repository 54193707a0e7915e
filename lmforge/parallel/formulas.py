"""Closed-form facts about parallel layouts, shared by the runtime (`lmforge.parallel`) and the
planner (`lmforge.plan`). Standard library only: the planner imports it without torch."""

from __future__ import annotations


def pipeline_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipelined step: (p-1)/v / (m + (p-1)/v), i.e. (p-1)/(m+p-1) for GPipe and
    1F1B and (p-1)/(v m + p-1) for interleaved 1F1B with v chunks per rank (m micro-batches, p ranks)."""
    if pp < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pp = {pp}, micro_batches = {micro_batches}, virtual_stages = {virtual_stages} must be >= 1")
    b = (pp - 1) / virtual_stages
    return b / (micro_batches + b)


def cp_kv_bytes(micro_batch: int, seq_len: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """Context parallelism: bytes of one layer's K and V for the whole sequences of a micro-batch,
    2 b s (kv_heads / tp) head_dim x dtype bytes. Every CP rank holds them after the all-gather and
    saves them for backward (the K/V term of a CP rank's activations, whatever cp), and it is the
    size of each all-gather output and of each reduce-scatter input."""
    return 2 * micro_batch * seq_len * (kv_heads // tp) * head_dim * dtype_bytes


def cp_latent_bytes(micro_batch: int, seq_len: int, latent_width: int, dtype_bytes: int) -> int:
    """Context parallelism with multi-head latent attention (lmforge.model.mla): bytes of one layer's
    gathered latent and RoPE key (`latent_width` = kv_lora_rank + qk_rope_head_dim per token, the same
    on every TP rank) for the whole sequences of a micro-batch: what its all-gather moves in place of
    K and V (`cp_kv_bytes`)."""
    return micro_batch * seq_len * latent_width * dtype_bytes


def cp_activation_bytes(single_rank_bytes: float, kv_bytes: float, cp: int) -> float:
    """Saved activations of one layer on one CP rank: the rank's 1/cp of the tokens, with the K/V of
    the whole sequence in place of its own share: (A - KV) / cp + KV, where A is the layer's
    activations for the whole sequence on one rank and KV = `cp_kv_bytes` (part of A: attention
    saves K and V in one process too). The attention keeps no mask and no score matrix (its output
    and log-sum-exp, as without CP: lmforge.parallel.context_parallel)."""
    return (single_rank_bytes - kv_bytes) / cp + kv_bytes


def cp_score_elements(seq_len: int, cp: int) -> int:
    """(query, key) scores a CP rank computes per head and sequence: chunk j's c queries against the
    (j + 1) c keys before and at it, for j = i and 2cp-1-i: c^2 (2 cp + 1), c = seq_len / (2 cp), the
    same on every rank: the causal work is balanced (contiguous slices of seq_len / cp tokens would
    give the last rank 2 cp / (cp + 1) times the mean). The kernels compute them block by block and
    keep none (lmforge.parallel.context_parallel); the literature's unfused score term counts them."""
    c = seq_len // (2 * cp)
    return c * c * (2 * cp + 1)


def cp_comm_bytes(kv_bytes: int, cp: int, n_layers: int, micro_batches: int, recomputed_layers: int = 0
                  ) -> dict[str, int]:
    """Context-parallel traffic of one optimizer step on one rank: per layer and micro-batch one K/V
    all-gather (output `kv_bytes`; again in backward for each of the `recomputed_layers` that
    activation checkpointing re-runs) and one reduce-scatter of their gradients (input `kv_bytes`).
    'collective_bytes' is the size of the tensors the collectives produce / consume; a ring
    algorithm sends and receives (cp - 1) / cp of it per rank ('wire_bytes'); 'calls' counts the
    collectives."""
    gathers = (n_layers + recomputed_layers) * micro_batches
    scatters = n_layers * micro_batches
    through = (gathers + scatters) * kv_bytes
    return {"all_gather_bytes": gathers * kv_bytes, "reduce_scatter_bytes": scatters * kv_bytes,
            "collective_bytes": through, "wire_bytes": through * (cp - 1) // cp, "calls": gathers + scatters}


def recomputed_layers(activation_checkpoint: str, n_layers: int, every: int = 2) -> int:
    """Of `n_layers` blocks, how many activation checkpointing re-runs forward in backward
    (lmforge.parallel.activation_ckpt): all of them under 'full' and 'selective' (the selective
    policy saves the matmul and attention outputs but still re-runs the block, collectives
    included), blocks 0, k, 2k, ... under 'every_k' (k = `every`), none under 'none'."""
    if activation_checkpoint == "none":
        return 0
    return len(range(0, n_layers, every)) if activation_checkpoint == "every_k" else n_layers

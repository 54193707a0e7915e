"""Activation checkpointing: trade recomputation in backward for activation memory.

Modes (config `train.activation_checkpoint`):
- ``none``: keep every activation.
- ``full``: wrap every transformer block; only block inputs are kept, everything inside a block
  is recomputed in backward (~one extra forward).
- ``every_k``: wrap blocks 0, k, 2k, ... (``train.ac_every``): memory/compute in between.
- ``selective``: wrap every block with an op-level policy (PyTorch's selective activation
  checkpointing): outputs of the expensive ops (matmuls and attention) are saved, the cheap
  pointwise ops (norms, activations, residual adds, RoPE) are recomputed. Most of the memory of
  ``none`` is pointwise intermediates, so this saves a good part of it at a few % of compute.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._efficient_attention_forward.default,  # (context parallel's lower-right chunks on CUDA)
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str, every: int = 2) -> int:
    """Wrap blocks of `blocks` in place according to `mode`; returns how many were wrapped."""
    if mode == "none":
        return 0
    if mode not in ("full", "every_k", "selective"):
        raise ValueError(f"train.activation_checkpoint = {mode!r} is not one of none, full, every_k, selective.")
    if every < 1:
        raise ValueError(f"train.ac_every = {every} must be >= 1.")
    wrapped = 0
    for i, (name, block) in enumerate(list(blocks.items())):
        if mode == "every_k" and i % every:
            continue
        if mode == "selective":
            block = checkpoint_wrapper(block, context_fn=_selective_contexts, preserve_rng_state=False)
        else:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        blocks[name] = block
        wrapped += 1
    return wrapped


def saved_activation_bytes(fn, exclude: "list[torch.Tensor] | None" = None) -> int:
    """Bytes of tensors autograd saves for backward while running `fn()` (unique storages),
    not counting the storages of `exclude` (pass the model's parameters: weights are saved for
    the matmul backward whatever the checkpointing mode).

    Used by tests and benchmarks to measure what activation checkpointing saves, on any device.
    """
    skip = {p.untyped_storage().data_ptr() for p in (exclude or [])}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


__all__ = ["apply_activation_checkpointing", "saved_activation_bytes"]

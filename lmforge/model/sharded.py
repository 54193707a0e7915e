"""This rank's part of a tensor that a layout sharded: a DTensor's local shard (FSDP2's or tensor
parallelism's: a view of its storage, writable, and under autograd the gradient flows back to the
shard), any other tensor as it is. One helper for the places that read or write a rank's own part:
the materialisation of sharded parameters, Gated DeltaNet's per-rank weights under TP, the
fault-tolerant groups' gradients and states, the certificate's planted faults."""

from __future__ import annotations

import torch


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t

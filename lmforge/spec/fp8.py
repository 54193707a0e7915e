"""Which linear layers FP8 training converts (train.fp8), by name and shape, before torch: the one rule of
lmforge.model.fp8's filter and of the planner's FP8 matmul time and FSDP2 gathers (lmforge.plan)."""

from __future__ import annotations

KEPT = ("lm_head", "router", "shared_gate")  # the layers that stay in the run's precision, by their last name


def candidate(fqn: str) -> bool:
    """A linear layer that FP8 may convert, by its (or its weight's) name: a block's, not one of KEPT."""
    name = fqn.removesuffix(".weight")
    return ".blocks." in f".{name}" and name.split(".")[-1] not in KEPT


def converts(fqn: str, shape: tuple[int, ...]) -> bool:
    """A `candidate` whose weight's [out, in] shape (before tensor parallelism) has dimensions that are
    multiples of 16 (what the FP8 GEMMs need)."""
    return candidate(fqn) and len(shape) == 2 and all(d % 16 == 0 for d in shape)

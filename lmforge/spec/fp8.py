"""Which linear layers FP8 training converts (train.fp8), by name and shape, before torch: the one rule of
lmforge.model.fp8's filter and of the planner's FP8 matmul time and FSDP2 gathers (lmforge.plan)."""

from __future__ import annotations

KEPT = ("lm_head", "router", "shared_gate")  # the layers that stay in the run's precision, by their last name


def converts(fqn: str, shape: tuple[int, ...]) -> bool:
    """A block's linear layer (its name, and its weight's [out, in] shape before tensor parallelism) that
    is not one of KEPT, its dimensions multiples of 16 (what the FP8 GEMMs need)."""
    name = fqn.removesuffix(".weight")
    return (".blocks." in f".{name}" and name.split(".")[-1] not in KEPT and len(shape) == 2
            and all(d % 16 == 0 for d in shape))

"""The memory conventions of the planner, each named for what it counts (lmforge.plan.memory's
docstring states every formula of each): "lmforge" (what lmforge allocates), "megatron"
(Megatron-LM's estimator: 18 B/param, its activation formula), "zero-paper" (the ZeRO paper's
16 B/param, Korthikanti et al.'s activations)."""

from __future__ import annotations


CONVENTIONS = ("lmforge", "megatron", "zero-paper")
LITERATURE = ("megatron", "zero-paper")


COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states", "ema", "activations", "buffers")
MODEL_STATES = COMPONENTS[:5]  # per parameter; `ema`: the EMA of the weights (train.ema_decay), 0 without one
MEGATRON_ALLOWANCE = 1.05  # Megatron's activation formula "without SP": x 1.05 for temporaries


def check_convention(name: str) -> str:
    """`name` if it is a memory convention, else a ValueError listing them."""
    if name not in CONVENTIONS:
        raise ValueError(f"memory convention {name!r} is not one of {', '.join(CONVENTIONS)}")
    return name

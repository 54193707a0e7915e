"""Analytical optimizer-state memory, in bytes per parameter.

The figures come from each optimizer's `StateSize` in `lmforge.spec.optimizers` (declared there
once); this module validates the arguments and blends Muon-style rules. It imports nothing but
the standard library: `lmforge plan` uses it to estimate memory before torch is even imported.
`measured_state_bytes` (in `lmforge.optim.optimizers`) is the empirical counterpart used by the tests
(tests/test_optim_state_size.py checks every registry entry) to keep these numbers honest.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmforge.spec.optimizers import OPTIMIZER_NAMES, REGISTRY  # noqa: F401 (OPTIMIZER_NAMES re-exported)


def optimizer_state_bytes_per_param(
    name: str,
    *,
    shape: Sequence[int] | None = None,
    muon_fraction: float = 1.0,
    block_size: int = 256,
    state_elem_bytes: int = 4,
) -> float:
    """Bytes of optimizer state per parameter element (per-tensor scalars such as `step` ignored).

    Args:
        name: an optimizer name accepted by `build_optimizer`.
        shape: for factored state ("adafactor"): the parameter's shape. A matrix of m x n keeps a row and a
            column second-moment factor, 4(m + n)/(m n) bytes per element (first moment off, as
            in torch.optim.Adafactor); a vector keeps a full second moment, 4 bytes. Leaving it
            out returns the large-matrix limit, 0.0 (the figure that matters for LLM weights;
            norms/biases are a negligible fraction of the parameters).
        muon_fraction: for optimizers with a separate rule for hidden matrices ("muon"): the
            fraction of parameters that sit in such matrices (Muon: one momentum buffer, 4
            bytes); the rest follow the other rule (Muon: AdamW, 8 bytes). The default 1.0
            returns the matrix figure.
        block_size: for block-quantised state ("adam8bit"): elements per quantisation block;
            each block of each quantised moment stores one fp32 absmax scale.
        state_elem_bytes: bytes of one state element for the full-precision optimizers
            (4 = fp32, the default; torch keeps state in the parameter dtype, so 2 for bf16
            parameters without fp32 master weights).

    Returns:
        Bytes per parameter element, e.g. 8.0 for AdamW with fp32 state, 2 (1 + 4/256) = 2.03125
        for adam8bit (exact up to the zero padding of each tensor's last block).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer name {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    if state_elem_bytes <= 0:
        raise ValueError(f"state_elem_bytes={state_elem_bytes} must be positive (4 for fp32, 2 for bf16)")
    if not 0.0 <= muon_fraction <= 1.0:
        raise ValueError(f"muon_fraction={muon_fraction} must be in [0, 1]")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive (default 256)")
    if shape is not None and any(int(d) <= 0 for d in shape):
        raise ValueError(f"shape={tuple(shape)} must have positive sizes")
    state = REGISTRY[name].state
    matrix, other = (state.element_bytes(shape, hidden_matrix=hidden, block_size=block_size,
                                         state_elem_bytes=state_elem_bytes) for hidden in (True, False))
    if matrix == other:  # one rule for every tensor
        return other
    return muon_fraction * matrix + (1.0 - muon_fraction) * other

"""Analytical optimizer-state memory, in bytes per parameter.

This module deliberately imports nothing but the standard library: `lmforge plan` uses it to
estimate memory before torch is even imported. `measured_state_bytes` (in `optimizers.py`) is the
empirical counterpart used by the tests to keep these numbers honest.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmforge.optim.registry import OPTIMIZER_NAMES, REGISTRY  # noqa: F401 (OPTIMIZER_NAMES re-exported)


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
        shape: only for "adafactor": the parameter's shape. A matrix of m x n keeps a row and a
            column second-moment factor, 4(m + n)/(m n) bytes per element (first moment off, as
            in torch.optim.Adafactor); a vector keeps a full second moment, 4 bytes. Leaving it
            out returns the large-matrix limit, 0.0 (the figure that matters for LLM weights;
            norms/biases are a negligible fraction of the parameters).
        muon_fraction: only for "muon": the fraction of parameters that sit in Muon-handled
            matrices (one momentum buffer, 4 bytes); the rest run AdamW (8 bytes). The default
            1.0 returns the matrix figure.
        block_size: only for "adam8bit": elements per quantisation block; each block of each
            of the two moments stores one fp32 absmax scale.
        state_elem_bytes: bytes of one state element for the full-precision optimizers
            (4 = fp32, the default; torch keeps state in the parameter dtype, so 2 for bf16
            parameters without fp32 master weights).

    Returns:
        Bytes per parameter element, e.g. 8.0 for AdamW with fp32 state, ~2.03 for adam8bit.
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer name {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    if state_elem_bytes <= 0:
        raise ValueError(f"state_elem_bytes={state_elem_bytes} must be positive (4 for fp32, 2 for bf16)")
    if REGISTRY[name].full_states is not None:  # element-wise: that many full-size tensors
        return float(REGISTRY[name].full_states * state_elem_bytes)
    if name == "adafactor":
        if shape is None:
            return 0.0
        dims = [int(d) for d in shape]
        if any(d <= 0 for d in dims):
            raise ValueError(f"shape={tuple(dims)} must have positive sizes")
        if len(dims) < 2:
            return float(state_elem_bytes)
        # torch factors the last two dims; leading dims act as a batch of matrices.
        m, n = dims[-2], dims[-1]
        return state_elem_bytes * (m + n) / (m * n)
    if name == "muon":
        if not 0.0 <= muon_fraction <= 1.0:
            raise ValueError(f"muon_fraction={muon_fraction} must be in [0, 1]")
        return state_elem_bytes * (1 * muon_fraction + 2 * (1.0 - muon_fraction))
    assert name == "adam8bit", name
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive (default 256)")
    # Two moments, each 1 byte of code per element plus one fp32 scale per block.
    return 2 * (1.0 + 4.0 / block_size)

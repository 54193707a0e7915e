"""Optimizers, learning-rate schedules and batch-size ramp-up.

Exports resolve lazily, so importing one submodule does not import the others. The optimizer table
and the state-memory figures, which config and `lmforge plan` read without torch, are in lmforge.spec
(`optimizers`, `optimizer_state`).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "OPTIMIZER_NAMES": "optimizers",
    "param_groups": "optimizers",
    "describe_groups": "optimizers",
    "build_optimizer": "optimizers",
    "measured_state_bytes": "optimizers",
    "Lion": "lion",
    "LAMB": "lamb",
    "Muon": "muon",
    "zeropower_via_newtonschulz5": "muon",
    "Adam8bit": "adam8bit",
    "lr_at": "schedules",
    "build_scheduler": "schedules",
    "BatchRampup": "schedules",
    "SCHEDULES": "schedules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines `name` on first access."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmforge.optim' has no attribute {name!r}")
    module = importlib.import_module(f"lmforge.optim.{_EXPORTS[name]}")
    return getattr(module, name)

"""Optimizers, learning-rate schedules and batch-size ramp-up.

Exports resolve lazily, so `from lmforge.optim.state_memory import optimizer_state_bytes_per_param`
(used by `lmforge plan`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "optimizer_state_bytes_per_param": "state_memory",
    "OPTIMIZER_NAMES": "state_memory",
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

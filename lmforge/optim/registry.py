"""The optimizers lmforge knows, in one table: config validation, `lmforge config --docs`, the
state-memory table (`lmforge.optim.state_memory`, used by `lmforge plan`) and `build_optimizer`
all read it.

Standard library only: `lmforge.config` and `lmforge plan` import it without importing torch.

Adding an optimizer: write its module in `lmforge/optim/` with a `build(model, cfg, extra)`
function (see `lmforge.optim.lion`), then add one `OptimizerSpec` line below.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    doc: str
    builder: str  # "module:function" under lmforge.optim, imported on first use (needs torch)
    full_states: int | None  # full-size fp32 state tensors per parameter; None = its own rule in state_memory
    fused: bool = False  # torch's fused / foreach kernels (optim.fused applies)


SPECS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec("sgd", "SGD without momentum (torch.optim.SGD)", "optimizers:build_sgd", 0, fused=True),
    OptimizerSpec("momentum", "SGD with (optionally Nesterov) momentum (torch.optim.SGD)", "optimizers:build_momentum",
                  1, fused=True),
    OptimizerSpec("adam", "Adam, weight decay as an L2 term (torch.optim.Adam)", "optimizers:build_adam", 2, fused=True),
    OptimizerSpec("adamw", "AdamW, decoupled weight decay (torch.optim.AdamW)", "optimizers:build_adamw", 2, fused=True),
    OptimizerSpec("lion", "Lion: sign of an interpolated momentum (Chen et al. 2023)", "lion:build", 1),
    OptimizerSpec("adafactor", "Adafactor: factored second moment, no first moment (torch.optim.Adafactor)",
                  "adafactor:build", None),
    OptimizerSpec("lamb", "LAMB: Adam with a per-layer trust ratio (You et al. 2019)", "lamb:build", 2),
    OptimizerSpec("muon", "Muon: orthogonalised momentum for 2-D matrices, AdamW for the rest", "muon:build", None),
    OptimizerSpec("adam8bit", "Adam with block-wise 8-bit quantised moments (Dettmers et al. 2021)",
                  "adam8bit:build", None),
)

REGISTRY: dict[str, OptimizerSpec] = {s.name: s for s in SPECS}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(REGISTRY)


def spec(name: str) -> OptimizerSpec:
    """The spec of `name`; ValueError listing the known names otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"unknown optimizer name {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return REGISTRY[name]


def names_with(fused: bool) -> tuple[str, ...]:
    """Names of the optimizers that do (fused=True) or do not have torch's fused kernels."""
    return tuple(s.name for s in SPECS if s.fused == fused)

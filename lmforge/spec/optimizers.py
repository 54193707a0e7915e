"""The optimizers lmforge knows, in one table: config validation, `lmforge config --docs`, the
state-memory figures (`lmforge.spec.optimizer_state` and `lmforge plan`) and `build_optimizer`
all read it.

Standard library only: `lmforge.config` and `lmforge plan` import it without importing torch.

Adding an optimizer: write its module in `lmforge/optim/` with a `build(model, cfg, extra)`
function (see `lmforge.optim.lion`), then add one `OptimizerSpec` line below, with a `StateSize`
saying what its `optimizer.state[p]` holds (tests/test_optim_state_size.py builds every entry and
checks that figure against the tensors the optimizer really keeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SCALE_BYTES = 4  # one fp32 absmax per block of a block-quantised tensor (lmforge.optim.quant8)


@dataclass(frozen=True)
class StateSize:
    """What an optimizer keeps in `optimizer.state[p]` for one parameter tensor p.

    full: tensors of p's size in the state dtype (the parameter's: fp32 in lmforge, whose
        parameters are the fp32 master weights): SGD's momentum buffer, Adam's m and v.
    quantised: tensors of p's size stored block-quantised in 8 bits (`lmforge.optim.quant8`,
        adam8bit's m and v): the tensor is flattened and zero-padded to whole blocks of
        `block_size` elements, one uint8 code per element plus one fp32 absmax per block, so
        ceil(n / block_size) x (block_size + 4) bytes, 1 + 4/block_size bytes per element up to
        the padding of the last block. Tensors with fewer than `min_8bit_size` elements keep
        these as plain fp32 tensors (4 bytes per element).
    factored: Adafactor's second moment (torch.optim.Adafactor, first moment off): a tensor of
        shape (..., m, n) keeps a row and a column factor, (...) x (m + n) elements; a vector
        keeps a full one.
    step_bytes: bytes of the per-tensor counters kept as tensors: torch's 0-dim fp32 `step`
        (4); a `step` kept as a Python int counts 0.
    matrices: the state of the tensors the optimizer treats as hidden matrices (2-D, not an
        embedding or the output head: Muon's orthogonalised matrices) when it differs from the
        rest; None = one rule for every tensor.
    """

    full: int = 0
    quantised: int = 0
    factored: bool = False
    step_bytes: int = 0
    matrices: StateSize | None = None

    def rule(self, hidden_matrix: bool) -> StateSize:
        """The state kept for a hidden matrix (`hidden_matrix=True`) or any other tensor."""
        return self.matrices if (hidden_matrix and self.matrices is not None) else self

    def element_bytes(self, shape: Sequence[int] | None = None, *, hidden_matrix: bool = True,
                      block_size: int = 256, state_elem_bytes: int = 4) -> float:
        """Bytes per parameter element, per-tensor counters and block padding left out.

        `shape` only matters for factored state; None gives the large-matrix limit, 0.
        `state_elem_bytes`: bytes of one element of a full (or factored) tensor; quantised
        tensors cost 1 + SCALE_BYTES / block_size whatever the parameter dtype.
        """
        r = self.rule(hidden_matrix)
        out = r.full * state_elem_bytes + r.quantised * (1.0 + SCALE_BYTES / block_size)
        if r.factored and shape is not None:
            dims = [int(d) for d in shape]
            if len(dims) < 2:
                out += state_elem_bytes
            else:  # the last two dims are factored; leading dims act as a batch of matrices
                m, n = dims[-2], dims[-1]
                out += state_elem_bytes * (m + n) / (m * n)
        return float(out)

    def tensor_bytes(self, shape: Sequence[int], *, hidden_matrix: bool, block_size: int = 256,
                     min_8bit_size: int = 4096, state_elem_bytes: int = 4) -> int:
        """Exact bytes of `optimizer.state[p]` for a parameter of `shape` (counters and padding in)."""
        r = self.rule(hidden_matrix)
        dims = [int(d) for d in shape]
        n = math.prod(dims)
        out = r.full * state_elem_bytes * n + r.step_bytes
        if r.factored:
            out += state_elem_bytes * (math.prod(dims[:-2]) * (dims[-2] + dims[-1]) if len(dims) >= 2 else n)
        if r.quantised:
            if n >= min_8bit_size:
                blocks = math.ceil(n / block_size)
                out += r.quantised * blocks * (block_size + SCALE_BYTES)
            else:
                out += r.quantised * 4 * n  # small tensors: plain fp32
        return out


_ADAM = StateSize(full=2, step_bytes=4)  # torch's Adam / AdamW: exp_avg, exp_avg_sq, a fp32 `step` tensor


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    doc: str
    builder: str  # "module:function" under lmforge.optim, imported on first use (needs torch)
    state: StateSize  # what optimizer.state[p] holds, per parameter tensor
    fused: bool = False  # torch's fused / foreach kernels (optim.fused applies)
    # torch's fused kernel also takes DTensor parameters (FSDP2 / TP): torch 2.13 has sharding rules
    # for the fused Adam/AdamW ops only (aten._fused_sgd_ raises NotImplementedError on DTensors)
    dtensor_fused: bool = False
    # which μP table sets its per-group learning-rate multipliers under model.parametrization = "mup"
    # (lmforge.model.mup.LR_EXPONENTS): "adam" (entrywise-normalised updates, L2 decay), "adamw" (the same with
    # decoupled decay), "sgd", "muon"; None = no μP rule (LAMB's trust ratio and Adafactor's relative step
    # scale each update by the parameter's own norm: not covered by the paper's tables)
    mup_rule: str | None = None


SPECS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec("sgd", "SGD without momentum (torch.optim.SGD)", "optimizers:build_sgd", StateSize(), fused=True, mup_rule="sgd"),
    OptimizerSpec("momentum", "SGD with (optionally Nesterov) momentum (torch.optim.SGD)", "optimizers:build_momentum",
                  StateSize(full=1), fused=True, mup_rule="sgd"),
    OptimizerSpec("adam", "Adam, weight decay as an L2 term (torch.optim.Adam)", "optimizers:build_adam", _ADAM,
                  fused=True, dtensor_fused=True, mup_rule="adam"),
    OptimizerSpec("adamw", "AdamW, decoupled weight decay (torch.optim.AdamW)", "optimizers:build_adamw", _ADAM,
                  fused=True, dtensor_fused=True, mup_rule="adamw"),
    OptimizerSpec("lion", "Lion: sign of an interpolated momentum (Chen et al. 2023)", "lion:build", StateSize(full=1),
                  mup_rule="adamw"),
    OptimizerSpec("adafactor", "Adafactor: factored second moment, no first moment (torch.optim.Adafactor)",
                  "adafactor:build", StateSize(factored=True, step_bytes=4)),
    OptimizerSpec("lamb", "LAMB: Adam with a per-layer trust ratio (You et al. 2019)", "lamb:build",
                  StateSize(full=2)),  # its step is a Python int
    OptimizerSpec("muon", "Muon: orthogonalised momentum for 2-D matrices, AdamW for the rest", "muon:build",
                  StateSize(full=2, step_bytes=4, matrices=StateSize(full=1)), mup_rule="muon"),
    OptimizerSpec("adam8bit", "Adam with block-wise 8-bit quantised moments (Dettmers et al. 2021)",
                  "adam8bit:build", StateSize(quantised=2), mup_rule="adamw"),  # m and v 8-bit + block scales; step a Python int
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

"""Initial weights as a function of (seed, parameter name, position): any rank can make exactly its
own part of any parameter, and every layout starts from the same numbers.

A sharded run never builds the whole model: it is constructed on the meta device, split and sharded
there (lmforge.parallel.parallelize), and each rank then allocates and fills only its shard
(`lmforge.model.materialise`). For the shards to add up to the model one process would build, a
parameter's values cannot come from one generator stream walked over the whole model in module
order. Here each parameter is cut into fixed blocks of rows (the cut depends only on the full shape),
and block b of parameter `name` is drawn from its own generator, seeded with a hash of (seed, name,
b). A rank draws the blocks that hold its rows and keeps the rows and columns it owns: it never holds
more than one parameter's rows of its shard, and a single process draws every block of every
parameter: the same numbers.

The rules (GPT-2 / nanoGPT style; `init_rule`):

* linear weights and embeddings: N(0, model.init_std); the residual output projections (``attn.wo``,
  ``mlp.proj``, ``mlp.down``; MoE experts' ``w_down`` and shared experts' ``down``) N(0, init_std /
  sqrt(2 n_layers)); MoE experts' stacked weights (experts along dim 0, so a rank holding some experts
  draws exactly their blocks) and routers N(0, init_std);
* model.parametrization = "mup": each of these stds x its μP factor (lmforge.model.mup: hidden matrices
  1/sqrt(m), the MoE router 1/m, embeddings and lm_head 1; m = dim / mup_base_width);
* biases 0; norm weights 1 (norm biases 0);
* Gated DeltaNet (lmforge.model.gated_deltanet): its projections as the linear weights above (`wo`
  a residual projection), the depthwise convolutions U(-1/sqrt(taps), 1/sqrt(taps)) (torch's own
  Conv1d init), `A_log` = log U(0.01, 16) and `dt_bias` = 1 (transformers' Qwen3-Next), the gated
  norm's weight 1;
* LoRA adapters (lmforge.model.lora): A ~ U(-1/sqrt(in), 1/sqrt(in)) (nn.Linear's Kaiming uniform),
  B = 0, so the adapted model starts as the base model; the q/k/v part adapters of a fused attn.wqkv
  draw the values of the separate projections' adapters (by the separate names).

Hand-written because torch has no counter-based random generator whose values can be drawn for an
arbitrary slice of a tensor: DTensor's own random ops give each shard values of its own, so the
result would depend on the layout.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model import mup
from lmforge.model.gated_deltanet import GatedRMSNorm
from lmforge.model.layers import QKV_PARTS, read_fused_qkv

BLOCK_ELEMENTS = 1 << 16  # values per generator block (rows of a parameter, at least one row)
RESIDUAL_PROJECTIONS = ("attn.wo", "mlp.proj", "mlp.down", "mlp.shared.down")  # (+ MoE experts' w_down)

Index = Sequence["torch.Tensor | None"]  # per dim of the full tensor: the indices kept (None: all of them)


@dataclass(frozen=True)
class InitRule:
    kind: str  # "normal" | "uniform" | "log_uniform" | "zeros" | "ones"
    scale: float = 0.0  # normal: the standard deviation; uniform: the bound; log_uniform: the upper bound
    low: float = 0.0  # log_uniform: log of U(low, scale)


def init_rule(cfg: ModelConfig, module: nn.Module, module_name: str, param_name: str) -> InitRule:
    """How the parameter `param_name` of `module` (named `module_name` in the unwrapped model) starts."""
    if param_name == "lora_a":
        return InitRule("uniform", 1.0 / math.sqrt(module.in_features))
    if param_name in ("lora_b", "bias"):
        return InitRule("zeros")
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, GatedRMSNorm)) or param_name == "dt_bias":
        return InitRule("ones")
    if param_name == "A_log":  # Gated DeltaNet's decay rates exp(A_log) in (0.01, 16), as transformers' Qwen3-Next
        return InitRule("log_uniform", 16.0, low=0.01)
    if isinstance(module, nn.Conv1d):  # (its depthwise convolutions: fan-in = the taps, torch's Conv1d bound)
        return InitRule("uniform", 1.0 / math.sqrt(module.kernel_size[0] * module.in_channels // module.groups))
    # model.parametrization = "mup": SP's std x the weight's μP factor (lmforge.model.mup; 1 under SP)
    std = cfg.init_std * mup.init_std_factor(cfg, mup.param_kind(f"{module_name}.{param_name}", 2))
    if param_name in ("w_gate", "w_up", "w_down"):  # MoE experts (lmforge.model.moe.GroupedExperts): per expert a linear
        return InitRule("normal", std / math.sqrt(2 * cfg.n_layers) if param_name == "w_down" else std)
    if isinstance(module, nn.Linear) and module_name.endswith(RESIDUAL_PROJECTIONS):
        return InitRule("normal", std / math.sqrt(2 * cfg.n_layers))
    assert isinstance(module, (nn.Linear, nn.Embedding)), (module_name, type(module))
    return InitRule("normal", std)


def block_rows(shape: Sequence[int]) -> int:
    """Rows (slices along dim 0) per generator block of a parameter of `shape`."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def init_values(rule: InitRule, name: str, shape: Sequence[int], index: Index, seed: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The initial values of parameter `name` (full shape `shape`) at `index` (per dim: the kept
    indices, None for all), on the CPU: the same numbers whichever part is asked for."""
    shape = tuple(shape)
    kept = [shape[d] if index[d] is None else len(index[d]) for d in range(len(shape))]
    if rule.kind in ("zeros", "ones"):
        return torch.full(kept, 1.0 if rule.kind == "ones" else 0.0, dtype=dtype)
    rows = torch.arange(shape[0]) if index[0] is None else index[0].to(torch.int64)
    per = block_rows(shape)
    out = torch.empty((len(rows), *shape[1:]))  # this part's rows, full width
    for b in torch.unique(rows // per).tolist():  # each generator block that holds some of them
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.empty((min(per, shape[0] - b * per), *shape[1:]))
        if rule.kind == "normal":
            block.normal_(0.0, rule.scale, generator=gen)
        elif rule.kind == "log_uniform":
            block.uniform_(rule.low, rule.scale, generator=gen).log_()
        else:
            block.uniform_(-rule.scale, rule.scale, generator=gen)
        mine = (rows // per) == b
        out[mine] = block[rows[mine] - b * per]
    for d in range(1, len(shape)):
        if index[d] is not None:
            out = out.index_select(d, index[d].to(torch.int64))
    return out.to(dtype)


_FUSED_ADAPTER = re.compile(r"(.*\battn\.)wqkv\.lora\.(wq|wk|wv)(\..*)?")


def separate_adapter_name(name: str) -> str:
    """The name a LoRA adapter on one part of a fused attn.wqkv (``..attn.wqkv.lora.wq[.lora_a]``,
    lmforge.model.lora.FusedQKVLoRA) has in the separate layout (``..attn.wq[.lora_a]``); other names
    as they are."""
    m = _FUSED_ADAPTER.fullmatch(name)
    return f"{m[1]}{m[2]}{m[3] or ''}" if m else name


def init_source(cfg: ModelConfig, seed: int):
    """A `lmforge.model.materialise` source: the initial values of any parameter's part."""

    def values(name: str, module: nn.Module, module_name: str, param_name: str, shape, index: Index,
               dtype: torch.dtype) -> torch.Tensor:
        rule = init_rule(cfg, module, module_name, param_name)
        if module_name.endswith("attn.wqkv") and param_name in ("weight", "bias"):
            # the fused projection (model.fused_qkv) starts as the separate wq/wk/wv would: each of
            # its rows drawn by the name and row of the projection it belongs to
            def part(p: int, shape, index) -> torch.Tensor:
                return init_values(rule, name.replace("attn.wqkv.", f"attn.{QKV_PARTS[p]}."), shape, index, seed, dtype)

            return read_fused_qkv(cfg, part, shape, index)
        # (a fused layer's q/k/v part adapters start as the separate projections' adapters)
        return init_values(rule, separate_adapter_name(name), shape, index, seed, dtype)

    return values

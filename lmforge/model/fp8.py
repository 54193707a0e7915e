"""FP8 training of the transformer blocks' linear layers through torchao (`train.fp8`, `train.fp8_recipe`).

`torchao.float8.convert_to_float8_training` swaps each selected `nn.Linear` for a `Float8Linear`:
weights stay fp32 master weights; inputs, weights and output gradients are cast to FP8 (e4m3
forward, e5m2 backward) with dynamic scales, and the matmuls run on the FP8 tensor cores (2x the
bf16 dense peak on H100). The recipe (torchao's names, as torchtitan exposes them):

- `tensorwise`: one scale per tensor. The only recipe torchao's float8 tensor-parallel styles and
  FSDP2's FP8 all-gather serve.
- `rowwise`: one scale per row of each operand (power-of-2 scales): more accurate, a little slower.
- `rowwise_with_gw_hp`: rowwise, and the weight gradient's matmul in high precision (its operands
  are the least FP8-friendly).

What converts (`fp8_filter`; the rule by name and shape: lmforge.spec.fp8), as torchtitan does: the blocks' plain `nn.Linear` layers whose
dimensions are multiples of 16 (what the FP8 GEMMs need). The output projection (`lm_head`), the
MoE router (`mlp.router`, its logits pick the experts) and shared-expert gate (`mlp.shared_gate`)
stay in the run's precision, as do LoRA layers (their adapters are not Float8Linear's) and MoE's
grouped experts (not `nn.Linear`); `left_out` lists the block linears left out for their shapes,
and the run's log names them.

Layouts: under tensor parallelism a tensorwise Float8Linear takes torchao's `Float8ColwiseParallel` /
`Float8RowwiseParallel` (lmforge.parallel.tensor_parallel: the same sharding, the casts after the
DTensor is made, so each scale is the whole tensor's, as in one process); rowwise layers take the
plain styles. Under FSDP2 with `train.fp8_all_gather` (tensorwise only) the shards are all-gathered
in FP8 (torchao's `enable_fsdp_float8_all_gather`: half the bytes of bf16), and `Fp8ScalesForFsdp`
precomputes every weight's scale in one all-reduce after each optimizer step (torchao's
`precompute_float8_dynamic_scale_for_fsdp`: lmforge.train.fp8, joined to the loop by its `update_end` event).

Where: CUDA GPUs with FP8 tensor cores (compute capability >= 8.9); and the CPU, where torch's
`_scaled_mm` computes the same FP8 arithmetic without FP8 units (slowly): a layout's FP8 parity is
checked on gloo there (tests/test_fp8.py), not its speed.

Apply it after the model is built and before tensor parallelism, activation checkpointing,
torch.compile and FSDP2 (`fully_shard` then shards Float8Linear weights; torch.compile fuses the
casts, which is where most of the speed comes from). torchao is optional: a clear error says how to
get it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmforge.spec.fp8 import candidate, converts

log = logging.getLogger("lmforge")


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(ok, reason): FP8 tensor cores need CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell); the
    CPU runs torch's FP8 matmul without them (for checking layouts, not for speed)."""
    if device.type == "cpu":
        return True, "the CPU: torch's _scaled_mm without FP8 units (for checking a layout, not for speed)"
    if device.type != "cuda":
        return False, f"train.fp8 needs a CUDA GPU (or the CPU, to check a layout), the run's device is {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"train.fp8 needs compute capability >= 8.9 (H100, H200, L4, B200); this GPU has {cap[0]}.{cap[1]}"
    return True, "ok"


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Convert block linears with FP8-friendly shapes; never the output projection, router or gate (a
    plain nn.Linear only: a LoRALinear is a subclass)."""
    return type(module) is nn.Linear and converts(fqn, (module.out_features, module.in_features))


def left_out(model: nn.Module) -> list[str]:
    """The block linears left in the run's precision for their shapes (a dimension not a multiple of 16)."""
    return [f"{name} ({m.out_features}x{m.in_features})" for name, m in model.named_modules()
            if type(m) is nn.Linear and candidate(name) and not fp8_filter(m, name)]


def fp8_config(recipe: str, all_gather: bool):
    """torchao's Float8LinearConfig for `recipe`, with FSDP2's FP8 all-gather where asked (tensorwise)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True) if all_gather else config


def apply_fp8(model: nn.Module, device: torch.device, recipe: str = "tensorwise", all_gather: bool = False) -> int:
    """Convert `model`'s block linears to torchao Float8Linear in place (`recipe`; `all_gather`: FSDP2 gathers
    the shards in FP8); returns how many, and logs the ones left out for their shapes."""
    if device.type == "cpu":  # (torchao's CUDA extensions do not load on a CPU build of torch: a warning each)
        logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise ImportError("train.fp8 = true needs torchao (torchao.float8): `pip install torchao`, or set "
                          "train.fp8 = false.") from exc
    ok, reason = fp8_supported(device)
    if not ok:
        raise ValueError(reason + "; set train.fp8 = false.")
    before = sum(1 for name, m in model.named_modules() if fp8_filter(m, name))
    skipped = left_out(model)
    convert_to_float8_training(model, module_filter_fn=fp8_filter, config=fp8_config(recipe, all_gather))
    if skipped:
        log.info("fp8: left in the run's precision for their shapes (a dimension not a multiple of 16): %s",
                 ", ".join(skipped))
    if device.type == "cpu":
        log.info("fp8 on %s", reason)
    return before


def is_float8(module: nn.Module) -> bool:
    """A torchao Float8Linear (by name: torchao is optional)."""
    return type(module).__name__ == "Float8Linear"


def tensorwise(module: nn.Module) -> bool:
    """A Float8Linear whose casts are one scale per tensor (what torchao's float8 TP styles serve)."""
    from torchao.float8.config import ScalingGranularity

    return is_float8(module) and all(
        c.scaling_granularity is ScalingGranularity.TENSORWISE
        for c in (module.config.cast_config_input, module.config.cast_config_weight,
                  module.config.cast_config_grad_output))

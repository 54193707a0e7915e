"""FP8 training of the transformer blocks' linear layers through torchao (`train.fp8`).

`torchao.float8.convert_to_float8_training` swaps each selected `nn.Linear` for a `Float8Linear`:
weights stay fp32 master weights; inputs, weights and output gradients are cast to FP8
(e4m3 forward, e5m2 backward) with dynamic per-tensor scales, and the matmuls run on the FP8
tensor cores (2x the bf16 dense peak on H100). As in torchtitan, the output projection
(`lm_head`, tied to the embedding) stays in the run's precision, and only layers whose
dimensions are multiples of 16 (what the FP8 GEMMs require) are converted.

Apply it after the model is built and before activation checkpointing, torch.compile and FSDP
(`fully_shard` then shards Float8Linear weights; torch.compile fuses the casts, which is where
most of the speed comes from). torchao is optional: a clear error says how to get it.
"""

from __future__ import annotations

import torch
from torch import nn


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(ok, reason): FP8 tensor cores need CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    if device.type != "cuda":
        return False, f"train.fp8 needs a CUDA GPU, the run's device is {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"train.fp8 needs compute capability >= 8.9 (H100, H200, L4, B200); this GPU has {cap[0]}.{cap[1]}"
    return True, "ok"


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Convert block linears with FP8-friendly shapes; never the output projection."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head" or not fqn.startswith("blocks."):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_fp8(model: nn.Module, device: torch.device) -> int:
    """Convert `model`'s block linears to torchao Float8Linear in place; returns how many."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as exc:
        raise ImportError("train.fp8 = true needs torchao (torchao.float8): `pip install torchao`, or set "
                          "train.fp8 = false.") from exc
    ok, reason = fp8_supported(device)
    if not ok:
        raise ValueError(reason + "; set train.fp8 = false.")
    before = sum(1 for name, m in model.named_modules() if fp8_filter(m, name))
    convert_to_float8_training(model, module_filter_fn=fp8_filter)
    return before

"""The rounding of a 16-bit run, perturbed: the reruns that measure a 16-bit layout's band
(lmforge/verify/band.py).

Inside `rounding_perturbed(seed)`, every nn.Linear whose output is bf16 or fp16 (autocast, bf16-pure)
returns its output times (1 + d), d drawn uniformly in [-eps, eps] of the output's dtype (bf16: 2^-7)
from a generator of its own (the run's RNG streams, data order and dropout, are untouched), computed in
fp32 and rounded back: each element moves by at most about one unit in the last place, the size of
the difference a layout makes by rounding partial matmul results at other places (TP's partial sums,
each rounded to 16 bits before the all-reduce). The factor also scales the gradient flowing back through
the output by the same (1 + d), so the backward's rounding is perturbed alike. fp32 outputs are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def rounding_perturbed(seed: int) -> Iterator[None]:
    gen = torch.Generator().manual_seed(seed)

    def hook(module: nn.Module, args, output):
        if not isinstance(module, nn.Linear) or not isinstance(output, torch.Tensor) or output.dtype not in SIXTEEN_BIT:
            return None
        eps = torch.finfo(output.dtype).eps
        d = (torch.rand(output.shape, generator=gen, dtype=torch.float32) * 2 - 1) * eps
        return (output.float() * (1 + d.to(output.device))).to(output.dtype)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()

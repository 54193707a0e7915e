"""The rounding of a 16-bit run, perturbed: the reruns that measure a 16-bit layout's band
(lmforge/verify/band.py).

Inside `rounding_perturbed(seed, precision)`, every module with weights of its own (linear layers,
embeddings, norms) returns its floating-point output times (1 + d), d drawn uniformly in [-eps, eps] of
the run's 16-bit dtype (bf16: 2^-7, fp16: 2^-10), from a generator of its own (the run's RNG streams,
data order and dropout, are untouched), computed in fp32 and cast back to the output's dtype. A 16-bit
output moves by at most about one unit in its last place; an fp32 output (one process under autocast
keeps embeddings, norms and the residual stream in fp32) by as much as rounding it to 16 bits would.
That is the size of the differences a correct layout makes: it rounds partial matmul results at other
places (TP's partial sums, each rounded before the all-reduce), and holds in 16 bits what one process
holds in fp32 (FSDP gathers every weight, embeddings and norms too, in bf16). The factor also scales
the gradient flowing back through the output by the same (1 + d), and each micro-batch's gradient of
the module's weights is moved alike (a layout computes weight gradients in 16 bits where one process
computes them in fp32: FSDP's norms and embeddings), so the backward's rounding is perturbed too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

EPS_OF = {"bf16": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def rounding_perturbed(seed: int, precision: str) -> Iterator[None]:
    if precision not in EPS_OF:
        raise ValueError(f"rounding_perturbed: precision {precision!r} has no 16-bit rounding to perturb; "
                         f"one of {', '.join(EPS_OF)}")
    eps = torch.finfo(EPS_OF[precision]).eps
    gen = torch.Generator().manual_seed(seed)

    def moved(t: torch.Tensor) -> torch.Tensor:
        d = (torch.rand(t.shape, generator=gen, dtype=torch.float32) * 2 - 1) * eps
        return (t.float() * (1 + d.to(t.device))).to(t.dtype)

    def hook(module: nn.Module, args, output):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not isinstance(output, torch.Tensor) or not output.is_floating_point() or not params:
            return None
        for p in params:  # (once per tensor: the fp32 parameter, or the step's 16-bit copy of it)
            if not getattr(p, "_rounding_perturbed", False):
                p.register_hook(moved)
                p._rounding_perturbed = True
        return moved(output)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()

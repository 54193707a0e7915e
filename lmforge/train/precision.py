"""Mixed precision: autocast for the forward pass, fp32 master weights, GradScaler for fp16.

Parameters and optimizer state always stay in fp32 (the "master weights"); autocast runs the
matmuls in bf16/fp16. bf16 has fp32's exponent range and needs no loss scaling; fp16 does, so
its gradients go through `torch.amp.GradScaler` (dynamic loss scale, skipped steps on inf/nan),
and the trainer unscales them before clipping.

One 16-bit copy of the weights per step, explicitly (`Precision.step(*modules)`): at the start of a
step the fp32 weight and bias of every linear layer the layout runs are cast to the compute dtype
once, and each module holds that copy in place of its parameter until the step ends (the swap
`torch.func.functional_call` makes: the module's `_parameters` entry, restored afterwards). The
cast is an autograd op, so every micro-batch's gradient flows back through it into the fp32 master
parameter's fp32 `.grad`. Every micro-batch, every micro-batch a pipeline schedule holds in
flight and every activation-checkpoint recompute reads that same copy, on whatever thread it runs;
autocast then finds the weights in 16 bits already and casts only activations.

Why not autocast's weight-cast cache (what lmforge relied on before, with an outer disabled
autocast context spanning the step): the cache is process-wide, but autocast's nesting count is
per thread, and leaving the outermost autocast context on a thread empties the whole cache. CUDA
runs backward on the autograd engine's device thread, where an activation-checkpoint recompute
enters and leaves autocast: that emptied the step's cache, and every later micro-batch and
recomputed block cast its weights again. (CPU backward runs on the calling thread, which hid it;
tests/test_gpu_semantics.py reproduces it with a backward on a second thread.) Why not FSDP2's
`MixedPrecisionPolicy` for every layout: it is FSDP2 (fully_shard on a device mesh), which would
replace the single-process, DDP and ZeRO-1 layouts rather than serve them. Where FSDP2 does run, its
policy gathers the parameters directly in 16 bits, so `step` leaves every module under an
`FSDPModule` alone.

What is copied: the fp32 parameters of `nn.Linear` and lmforge's `LoRALinear` (their forward is
`F.linear` over their own parameters, which autocast would cast). TP's DTensor parameters give
DTensor copies with the same placements. The chunked loss (train.loss_chunk) reads the head's
copy too, and its weight gradient returns through it in 16 bits, as the plain head's does. Left
to themselves: torchao's `Float8Linear` (it casts its fp32 weight to fp8 itself), embeddings and
norms (autocast keeps them in fp32).
Outside a step (evaluation, sampling) the modules hold their fp32 parameters and autocast casts
per forward. Memory: one 16-bit copy of those weights for the step, as autocast's cache held
(`lmforge.plan.memory` counts it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.model.lora import LoRALinear
from lmforge.train.profiler import measure_matmul_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# modules whose forward is F.linear over their own parameters: their 16-bit copies are made per step
COPIED_MODULES = (nn.Linear, LoRALinear)


@dataclass
class Precision:
    name: str
    device_type: str
    scaler: torch.amp.GradScaler

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around a forward pass."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    @contextlib.contextmanager
    def step(self, *modules: nn.Module) -> Iterator[None]:
        """Around one optimizer step's forwards and backwards through `modules` (what the layout
        runs): their linear layers hold one 16-bit copy of their weights for the step (module
        docstring); the fp32 parameters are back in place when it exits."""
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            if self.name != "fp32":
                copies: dict[int, torch.Tensor] = {}  # (a parameter shared by two layers: one copy)
                for module, name, param in copied_parameters(modules):
                    if id(param) not in copies:
                        copies[id(param)] = param.to(self.dtype)  # differentiable: grads reach the fp32 param
                    # hand-written, as torch.func.functional_call swaps tensors in (NamedMemberAccessor):
                    # nn.Module.__setattr__ accepts only an nn.Parameter for a parameter's name
                    module._parameters[name] = copies[id(param)]
                    swapped.append((module, name, param))
            yield
        finally:
            for module, name, param in reversed(swapped):
                module._parameters[name] = param

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by the GradScaler (a no-op scale unless fp16)."""
        self.scaler.scale(loss).backward()


def copied_parameters(roots: Iterable[nn.Module]) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, parameter) of every fp32 parameter of the `COPIED_MODULES` under `roots`, except
    under an FSDP2 module (it gathers its parameters in 16 bits itself); each module once."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch built without distributed)
        FSDPModule = ()  # noqa: N806
    seen: set[int] = set()
    stack = [(root, False) for root in roots]
    while stack:
        module, under_fsdp = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        under_fsdp = under_fsdp or isinstance(module, FSDPModule)
        if not under_fsdp and type(module) in COPIED_MODULES:
            for name, param in list(module._parameters.items()):
                if param is not None and param.dtype == torch.float32:
                    yield module, name, param
        stack.extend((child, under_fsdp) for child in module.children())


@dataclass
class Resolved:
    name: str  # fp32 | bf16 | fp16
    reason: str
    slow: bool = False  # the configured precision is emulated here: warn


def resolve_precision(name: str, device: torch.device) -> Resolved:
    """Turn 'auto' into a concrete precision for `device`, and say why.

    CUDA: bf16 where the GPU supports it, else fp16. CPU: bf16 only if this CPU really runs
    bf16 matmuls faster than fp32 (AMX / AVX512-BF16 CPUs do, by 2-6x; on AVX2-only CPUs
    oneDNN emulates bf16 and it is 10-100x *slower*), decided by timing a matmul in each dtype
    (the same cached measurement the MFU peak uses, so it is taken once per run). An explicit bf16
    on such a CPU is kept, flagged `slow`.
    """
    if device.type == "cpu" and name in ("auto", "bf16"):
        fp32 = measure_matmul_flops(device, torch.float32)  # FLOP/s
        bf16 = measure_matmul_flops(device, torch.bfloat16)
        if name == "bf16":
            if bf16 < 0.5 * fp32:  # no native bf16 units: oneDNN emulates it
                return Resolved(name, f"as configured, but this CPU emulates bf16: its matmuls run {fp32 / bf16:.0f}x "
                                      f"slower than fp32 here; --train.precision auto (or fp32) trains much faster on "
                                      f"this machine", slow=True)
            return Resolved(name, "as configured")
        if bf16 > 1.2 * fp32:
            return Resolved("bf16", f"bf16 matmul {bf16 / fp32:.1f}x faster than fp32 on this CPU")
        return Resolved("fp32", f"bf16 matmul {fp32 / bf16:.1f}x slower than fp32 on this CPU (no native bf16 units)")
    if name != "auto":
        return Resolved(name, "as configured")
    if torch.cuda.is_bf16_supported():
        return Resolved("bf16", "GPU supports bf16")
    return Resolved("fp16", "GPU lacks bf16")


def make_precision(name: str, device: torch.device) -> Precision:
    """Precision for `name` ('auto' must be resolved first with `resolve_precision`)."""
    if name not in DTYPES:
        raise ValueError(f"train.precision = {name!r} is not one of {', '.join(DTYPES)}.")
    scaler = torch.amp.GradScaler(device.type, enabled=(name == "fp16"))
    return Precision(name=name, device_type=device.type, scaler=scaler)

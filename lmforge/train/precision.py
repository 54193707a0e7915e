"""Mixed precision: autocast for the forward pass, fp32 master weights, GradScaler for fp16.

Parameters and optimizer state always stay in fp32 (the "master weights"); autocast runs the
matmuls in bf16/fp16. bf16 has fp32's exponent range and needs no loss scaling; fp16 does, so
its gradients go through `torch.amp.GradScaler` (dynamic loss scale, skipped steps on inf/nan),
and the trainer unscales them before clipping.

One 16-bit copy of the weights per step: autocast caches the cast of each fp32 weight until the
outermost autocast context exits. `Precision.step()` is such an outer context (autocast itself
disabled) around all of a step's micro-batches, each forward inside its own `autocast()`: every
micro-batch, and every micro-batch a pipeline schedule holds in flight, reuses the one cast,
instead of keeping a copy of its own for backward. (FSDP2 layouts gather parameters directly in
16 bits and cast nothing.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lmforge.train.profiler import measure_matmul_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    def step(self) -> contextlib.AbstractContextManager:
        """Around one optimizer step's forwards and backwards: keeps autocast's weight casts alive."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by the GradScaler (a no-op scale unless fp16)."""
        self.scaler.scale(loss).backward()


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

"""Mixed precision: which precision a run trains in, and one 16-bit copy of the weights per step.

Parameters and optimizer state always stay in fp32 (the "master weights"); autocast runs the
matmuls in bf16/fp16. bf16 has fp32's exponent range and needs no loss scaling; fp16 does, so
its gradients go through `torch.amp.GradScaler` (dynamic loss scale, skipped steps on inf/nan),
and the trainer unscales them before clipping.

Deciding the precision (`resolve_precision`), once per run: rank 0 decides and the trainer
broadcasts its decision, so every rank computes in the same dtype (collectives of different
dtypes fail, e.g. gloo's "Received data size doesn't match expected size").

- An explicit fp32 / bf16 / fp16 is used as configured. bf16 on a CPU without native bf16 matmul
  units is kept but flagged `slow` (oneDNN emulates it there, 10-100x slower than fp32).
- `auto` is decided from the hardware, never from a timing: CUDA gives bf16 where the GPU has bf16
  tensor cores (compute capability >= 8.0), else fp16 (V100, T4). A CPU gives bf16 only where it
  has native bf16 matmul units (`cpu_bf16_units`: AMX-BF16 or AVX512-BF16 in /proc/cpuinfo's
  flags; oneDNN runs bf16 2-6x faster than fp32 there), else fp32.
- A checkpoint records the precision its run trained in (meta "precision"). Under `auto` a resumed
  run keeps it, whatever this machine's hardware would choose; an explicit train.precision wins,
  with a warning that the precision changed.
- What `auto` resolves to is checked against the layout afterwards
  (`lmforge.config.rules.check_resolved_precision`: no fp16 with TP / PP).

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

What is copied: the fp32 parameters of `nn.Linear` and lmforge's LoRA modules (their forward is
`F.linear` over their own parameters, which autocast would cast) and of MoE's `GroupedExperts` (the
experts' stacked weights, one grouped GEMM per projection, which autocast does not cast: CPU, torch
2.13; lmforge.model.moe casts the experts' input to autocast's dtype and finds the weights in it
already). TP's DTensor parameters give DTensor copies with the same placements. The chunked loss
(train.loss_chunk) reads the head's copy too, and its weight gradient returns through it in 16
bits, as the plain head's does. Left
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
from pathlib import Path

import torch
from torch import nn

from lmforge.model.lora import FusedQKVLoRA, LoRALinear, QKVAdapter
from lmforge.model.moe import GroupedExperts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# modules whose forward is F.linear over their own parameters: their 16-bit copies are made per step
# (a QKVAdapter's parameters: F.linear in its FusedQKVLoRA's forward), and MoE's stacked experts (a
# grouped GEMM per projection over their own weights, in the dtype of their autocast-cast input)
COPIED_MODULES = (nn.Linear, LoRALinear, FusedQKVLoRA, QKVAdapter, GroupedExperts)


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
    changed: bool = False  # an explicit setting overrides the precision of the checkpoint being resumed: warn


CPU_BF16_UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}  # /proc/cpuinfo flag -> name


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (the first "flags" line of /proc/cpuinfo); empty where there is none
    (not Linux): its bf16 units are then unknown, and `auto` stays fp32."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split())
    except OSError:
        pass
    return set()


def cpu_bf16_units(flags: set[str]) -> list[str]:
    """The native bf16 matmul units among a CPU's flags ([] = oneDNN emulates bf16 there)."""
    return [unit for flag, unit in CPU_BF16_UNITS.items() if flag in flags]


def hardware_precision(device_type: str, cuda_bf16: bool = False, flags: set[str] = frozenset()) -> Resolved:
    """What `auto` means on this hardware (module docstring): `cuda_bf16` whether the GPU has bf16
    tensor cores, `flags` the CPU's /proc/cpuinfo flags."""
    if device_type == "cuda":
        return Resolved("bf16", "GPU has bf16 tensor cores") if cuda_bf16 else \
            Resolved("fp16", "GPU lacks bf16 tensor cores (compute capability < 8.0)")
    units = cpu_bf16_units(flags) if device_type == "cpu" else []
    if units:
        return Resolved("bf16", f"CPU has native bf16 matmul units ({', '.join(units)})")
    return Resolved("fp32", f"{device_type.upper()} has no native bf16 matmul units (AMX-BF16, AVX512-BF16): "
                            f"bf16 would be emulated, 10-100x slower than fp32")


def detect_hardware_precision(device: torch.device) -> Resolved:
    """`hardware_precision` of this process's device."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return hardware_precision("cuda", cuda_bf16=torch.cuda.is_bf16_supported(including_emulation=False))
    return hardware_precision(device.type, flags=cpu_flags() if device.type == "cpu" else set())


def resolve_precision(name: str, device: torch.device, saved: str | None = None) -> Resolved:
    """Turn train.precision into a concrete precision for `device`, and say why (module docstring).
    `saved`: the precision recorded in the checkpoint being resumed (None: a fresh run, or a
    checkpoint that did not record it). Called on rank 0; the trainer broadcasts the answer."""
    hardware = detect_hardware_precision(device)
    if name == "auto" and saved is None:
        return hardware
    if name == "auto":
        chosen = saved
        note = "" if saved == hardware.name else f"; this hardware alone would choose {hardware.name}"
        reason = f"the resumed checkpoint trained in {saved} (train.precision = auto keeps it{note})"
    else:
        chosen, reason = name, "as configured"
    slow = device.type == "cpu" and chosen == "bf16" and hardware.name != "bf16"
    if slow:
        reason += (", but this CPU emulates bf16 (no AMX-BF16 or AVX512-BF16 units): its matmuls run 10-100x "
                   "slower than fp32; --train.precision fp32 trains much faster on this machine")
    changed = name != "auto" and saved is not None and saved != name
    if changed:
        reason += f"; it overrides the {saved} the resumed checkpoint trained in"
    return Resolved(chosen, reason, slow=slow, changed=changed)


def make_precision(name: str, device: torch.device) -> Precision:
    """Precision for `name` ('auto' must be resolved first with `resolve_precision`)."""
    if name not in DTYPES:
        raise ValueError(f"train.precision = {name!r} is not one of {', '.join(DTYPES)}.")
    scaler = torch.amp.GradScaler(device.type, enabled=(name == "fp16"))
    return Precision(name=name, device_type=device.type, scaler=scaler)

"""Mixed precision: which precision a run trains in, and one 16-bit copy of the weights per step.

Parameters and optimizer state always stay in fp32 (the "master weights"). Four modes
(train.precision):

- fp32: no 16-bit anything.
- bf16 / fp16 (autocast): the step's 16-bit copies of the linear layers' weights (below), and
  autocast runs the matmuls in 16 bits; norms, softmax and the residual stream stay fp32. bf16 has
  fp32's exponent range and needs no loss scaling; fp16 does, so its gradients go through
  `torch.amp.GradScaler` (dynamic loss scale, skipped steps on inf/nan), and the trainer unscales
  them before clipping.
- bf16-pure: 16-bit training end to end, as llm.c and Megatron run it. Every floating parameter the
  layout runs (linears, norms, biases, MoE experts, LoRA adapters, the head) is cast to bf16 once per
  step and the forward runs WITHOUT autocast, so the activations and the residual stream are bf16
  from the embedding on: half the bytes of every elementwise op between the matmuls. Norms compute
  their statistics in fp32 inside torch's kernels and return bf16 (the result is the fp32 norm
  rounded once); RoPE rotates in fp32 and casts back; the loss (softmax, log-sum-exp) is fp32.
  Embedding lookups read their fp32 master rows and their output is cast to bf16 (a forward hook for
  the step): a lookup reads d values per token, and its backward then adds the gradients of every
  occurrence of a token in fp32 (the CPU's bf16 embedding backward adds them in bf16: ~10% error for a
  token seen thousands of times in a batch). The cast's backward upcasts each micro-batch's bf16
  gradient into the fp32 parameter's fp32 `.grad`, so gradients accumulate across micro-batches in
  fp32 (Megatron's "main gradients") and DDP / FSDP2 reduce them in fp32 (parallel.ddp_comm_hook =
  bf16 halves DDP's bytes where NCCL serves it). The master weights stay the module's fp32 parameters:
  FSDP2 / ZeRO / TP / PP shard them, every optimizer steps them and checkpoints hold them exactly as
  in the autocast modes (no new replicated bytes), so a run resumes in either mode. Memory per
  parameter with AdamW: fp32 master 4 + fp32 gradient 4 + the step's bf16 copy 2 + the states 8 =
  Megatron's 18 bytes. No GradScaler (bf16's range needs none).
  Under FSDP2 its `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` gathers every
  parameter (embeddings and norms too) in bf16 already, as in the bf16 mode; without autocast the
  forward computes in what it gathered. (CUDA's embedding backward accumulates in fp32 internally;
  on the CPU FSDP2's bf16 embedding adds its gradient in bf16: lmforge only trains small models there.)
  Evaluation and sampling outside a step run as in bf16: autocast over the fp32 masters (the
  weights the checkpoint and model.safetensors hold), so validation losses of the two bf16 modes
  are measured the same way.

Deciding the precision (`resolve_precision`), once per run: rank 0 decides and the trainer
broadcasts its decision, so every rank computes in the same dtype (collectives of different
dtypes fail, e.g. gloo's "Received data size doesn't match expected size").

- An explicit fp32 / bf16 / fp16 / bf16-pure is used as configured. bf16 (either mode) on a CPU
  without native bf16 matmul units is kept but flagged `slow` (oneDNN emulates it there, 10-100x
  slower than fp32).
- `auto` is decided from the hardware, never from a timing: CUDA gives bf16-pure where the GPU has
  bf16 tensor cores (compute capability >= 8.0), else fp16 (V100, T4). bf16-pure because it measured
  faster than bf16 autocast there (the GPU suite's bf16-pure rows on an H100, 2026-11-27: GPT-2 124M
  +2.5%, the 1B +2.1%; benchmarks/RESULTS.md), on every layout's parity (tests/test_bf16_pure.py).
  A CPU gives bf16 only where it has native bf16 matmul units (`cpu_bf16_units`: AMX-BF16 or
  AVX512-BF16 in /proc/cpuinfo's flags; oneDNN runs bf16 2-6x faster than fp32 there), else fp32
  (bf16-pure measured no faster than autocast on such a CPU: benchmarks/RESULTS.md, "Step time per
  precision mode").
- A checkpoint records the precision its run trained in (meta "precision"). Under `auto` a resumed
  run keeps it, whatever this machine's hardware would choose; an explicit train.precision wins,
  with a warning that the precision changed.
- What `auto` resolves to is checked against the layout afterwards
  (`lmforge.config.rules.check_resolved_precision`: no fp16 with TP / PP).

One 16-bit copy of the weights per step, explicitly (`Precision.step(*modules)`): at the start of a
step the fp32 weight and bias of every linear layer the layout runs (bf16-pure: every floating
parameter but the embeddings') are cast to the compute dtype once, and each module holds that copy
in place of its parameter until the step ends (the swap `torch.func.functional_call` makes: the
module's `_parameters` entry, restored afterwards). The cast is an autograd op, so every
micro-batch's gradient flows back through it into the fp32 master parameter's fp32 `.grad`. Every
micro-batch, every micro-batch a pipeline schedule holds in flight and every activation-checkpoint
recompute reads that same copy, on whatever thread it runs; autocast (bf16, fp16) then finds the
weights in 16 bits already and casts only activations.

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

What is copied in the autocast modes: the fp32 parameters of `nn.Linear` and lmforge's LoRA modules
(their forward is `F.linear` over their own parameters, which autocast would cast) and of MoE's
`GroupedExperts` (the experts' stacked weights, one grouped GEMM per projection, which autocast does
not cast: CPU, torch 2.13; lmforge.model.moe casts the experts' input to autocast's dtype and finds
the weights in it already). TP's DTensor parameters give DTensor copies with the same placements.
The chunked loss (train.loss_chunk) reads the head's copy too, and its weight gradient returns
through it in 16 bits, as the plain head's does. Left to themselves: torchao's `Float8Linear` (it
casts its fp32 weight to fp8 itself, in every mode), embeddings and norms (autocast keeps them in
fp32; bf16-pure copies the norms).
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

from lmforge.model.lora import FusedQKVLoRA, LoRALinear, QKVAdapter
from lmforge.model.moe import GroupedExperts
from lmforge.spec.precision import Resolved, cpu_flags, hardware_precision

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16}
PURE = frozenset({"bf16-pure"})  # modes that train without autocast, every parameter cast per step

# modules whose forward is F.linear over their own parameters: their 16-bit copies are made per step
# (a QKVAdapter's parameters: F.linear in its FusedQKVLoRA's forward), and MoE's stacked experts (a
# grouped GEMM per projection over their own weights, in the dtype of their autocast-cast input)
COPIED_MODULES = (nn.Linear, LoRALinear, FusedQKVLoRA, QKVAdapter, GroupedExperts)
# modules that cast their own fp32 weights (torchao's Float8Linear: to fp8, with its scales): never
# copied, in any mode (by name: torchao is optional)
OWN_CAST_MODULES = frozenset({"Float8Linear"})


@dataclass
class Precision:
    name: str
    device_type: str
    scaler: torch.amp.GradScaler

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def pure(self) -> bool:
        """bf16-pure: every parameter cast per step, no autocast in training (module docstring)."""
        return self.name in PURE

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around a forward pass outside a step (evaluation, sampling: bf16-pure too, over the fp32
        masters), and a training forward of the autocast modes."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def training_forward(self) -> contextlib.AbstractContextManager:
        """Around a training forward inside `step`: autocast (bf16, fp16), or nothing (fp32; bf16-pure,
        whose weights and activations are bf16 already)."""
        return contextlib.nullcontext() if self.pure else self.autocast()

    @contextlib.contextmanager
    def step(self, *modules: nn.Module) -> Iterator[None]:
        """Around one optimizer step's forwards and backwards through `modules` (what the layout
        runs): their linear layers hold one 16-bit copy of their weights for the step (module
        docstring); the fp32 parameters are back in place when it exits."""
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        hooks = []
        try:
            if self.name != "fp32":
                copies: dict[int, torch.Tensor] = {}  # (a parameter shared by two layers: one copy)
                for module, name, param in copied_parameters(modules, every=self.pure):
                    if id(param) not in copies:
                        copies[id(param)] = param.to(self.dtype)  # differentiable: grads reach the fp32 param
                    # hand-written, as torch.func.functional_call swaps tensors in (NamedMemberAccessor):
                    # nn.Module.__setattr__ accepts only an nn.Parameter for a parameter's name
                    module._parameters[name] = copies[id(param)]
                    swapped.append((module, name, param))
            if self.pure:  # the fp32 lookups' outputs in bf16: the residual stream starts in bf16
                hooks = [m.register_forward_hook(_cast_output(self.dtype)) for m in embeddings(modules)]
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for module, name, param in reversed(swapped):
                module._parameters[name] = param

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, scaled by the GradScaler (a no-op scale unless fp16)."""
        self.scaler.scale(loss).backward()


def copied_parameters(roots: Iterable[nn.Module], every: bool = False) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(module, name, parameter) of every fp32 parameter of the `COPIED_MODULES` under `roots` (`every`:
    of every module but embeddings and `OWN_CAST_MODULES`: bf16-pure), except under an FSDP2 module
    (it gathers its parameters in 16 bits itself); each module once."""
    for module in _modules(roots):
        kind = type(module)
        copied = (not isinstance(module, nn.Embedding) and kind.__name__ not in OWN_CAST_MODULES) if every \
            else kind in COPIED_MODULES
        if copied:
            for name, param in list(module._parameters.items()):
                if param is not None and param.dtype == torch.float32:
                    yield module, name, param


def embeddings(roots: Iterable[nn.Module]) -> Iterator[nn.Module]:
    """The `nn.Embedding` modules under `roots`, except under an FSDP2 module (its policy gathers
    them in 16 bits, so their outputs are 16-bit already)."""
    return (m for m in _modules(roots) if isinstance(m, nn.Embedding))


def _modules(roots: Iterable[nn.Module]) -> Iterator[nn.Module]:
    """Every module under `roots` once, but none under an FSDP2 module (`FSDPModule`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch built without distributed)
        FSDPModule = ()  # noqa: N806
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        module = stack.pop()
        if id(module) in seen or isinstance(module, FSDPModule):
            continue
        seen.add(id(module))
        yield module
        stack.extend(module.children())


def _cast_output(dtype: torch.dtype):
    """A forward hook that returns the module's output in `dtype` (differentiable)."""
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)
    return hook


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
    slow = device.type == "cpu" and DTYPES[chosen] == torch.bfloat16 and hardware.name != "bf16"
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

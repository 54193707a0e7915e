"""What train.precision = "auto" resolves to on a kind of hardware (standard library only, so that the
planner, which does not import torch, applies the trainer's rule): lmforge.train.precision decides
with it on the run's device, `lmforge plan` on a catalogue GPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Resolved:
    name: str  # fp32 | bf16 | fp16 | bf16-pure
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
    """What `auto` means on this hardware (lmforge.train.precision's module docstring): `cuda_bf16` whether the GPU has bf16
    tensor cores, `flags` the CPU's /proc/cpuinfo flags."""
    if device_type == "cuda":  # (bf16-pure: measured faster than autocast, benchmarks/RESULTS.md)
        return Resolved("bf16-pure", "GPU has bf16 tensor cores; bf16-pure trained faster than bf16 autocast on an "
                                     "H100: GPT-2 124M +2.5%, the 1B +2.1%") if cuda_bf16 else \
            Resolved("fp16", "GPU lacks bf16 tensor cores (compute capability < 8.0)")
    units = cpu_bf16_units(flags) if device_type == "cpu" else []
    if units:
        return Resolved("bf16", f"CPU has native bf16 matmul units ({', '.join(units)})")
    return Resolved("fp32", f"{device_type.upper()} has no native bf16 matmul units (AMX-BF16, AVX512-BF16): "
                            f"bf16 would be emulated, 10-100x slower than fp32")

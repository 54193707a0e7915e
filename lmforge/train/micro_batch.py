"""`train.micro_batch_size = "auto"` resolved at run start: the memory free on the run's device,
handed to the planner's rule (`lmforge.plan.micro_batch.choose_micro_batch`)."""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.plan.micro_batch import MicroBatchChoice, choose_micro_batch


def free_memory_bytes(device: torch.device) -> float | None:
    """Memory free for the run: on a CUDA GPU what the driver reports free now (the CUDA context and
    any other process's allocations already taken off); on a CPU the RAM the kernel reports
    available (/proc/meminfo's MemAvailable); None where neither is known."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    if device.type == "cpu" and meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return None


def decide_micro_batch(cfg, precision: str, device: torch.device) -> MicroBatchChoice:
    """The micro-batch for "auto" on `device` in `precision` (as resolved), from the planner's rule."""
    return choose_micro_batch(cfg, precision, device.type, free_memory_bytes(device))

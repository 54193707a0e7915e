"""`train.micro_batch_size = "auto"`: the largest micro-batch the memory plan fits on the device.

The rule (`choose_micro_batch`), applied once at run start (lmforge.train.micro_batch) by rank 0 for
every rank, and by `lmforge plan` for the GPUs it plans:

- candidates: the micro-batch sizes the layout can run (`lmforge.config.rules.valid_micro_batches`:
  divisors of the global batch per data-parallel rank, >= pp micro-batches under a pipeline, the
  batch ramp-up's steps whole);
- the largest candidate whose planned peak (`estimate_memory`, the "lmforge" convention: what lmforge
  allocates, with the run's layout, precision, activation checkpointing, optimizer and chunked loss)
  is at most `AUTO_HEADROOM` (85%) of the device memory free at run start. The other 15% covers the
  plan's own error (on the H100 it planned 1.6-8% above the measured peaks of its target rows, and
  20% above one compiled run without checkpointing, all on the safe side: benchmarks/RESULTS.md),
  cuBLAS / cuDNN workspaces and the caching allocator's fragmentation;
- on a CPU at most `CPU_MAX_MICRO_BATCH` (16, the key's default): a CPU's matmuls reach their rate
  at a few thousand tokens, so larger micro-batches buy no speed there, only memory; the plan is
  checked against the RAM available at run start;
- where even the smallest candidate does not fit, the smallest (the run may then run out of
  memory; the log says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.rules import valid_micro_batches
from lmforge.plan.layout import layout_for_config
from lmforge.plan.memory import estimate_memory

AUTO_HEADROOM = 0.85
CPU_MAX_MICRO_BATCH = 16


@dataclass(frozen=True)
class MicroBatchChoice:
    size: int
    planned_bytes: float       # the planned peak per GPU at that size
    budget_bytes: float | None  # AUTO_HEADROOM x the memory free (None: not known, not checked)
    reason: str                # one line for the run's log


def largest_fitting(sizes: list[int], layout_at, model_cfg, optimizer: str, seq_len: int, budget: float | None
                    ) -> tuple[int, float, str]:
    """(size, its planned peak, a note on the next larger size refused): the largest of `sizes` whose
    planned peak (`estimate_memory` of `layout_at(size)`, lmforge convention) is within `budget`
    bytes (None: the largest), else the smallest."""
    refused = ""
    for m in reversed(sizes):
        planned = estimate_memory(model_cfg, layout_at(m), optimizer, seq_len).total
        if budget is None or planned <= budget or m == sizes[0]:
            return m, planned, refused
        refused = f"; {m} would need {planned / 1e9:.2f} GB"  # (the next larger size, at the end)
    raise AssertionError("no micro-batch size to choose from")


def choose_micro_batch(config, precision: str, device_type: str, free_bytes: float | None) -> MicroBatchChoice:
    """train.micro_batch_size for "auto" (module docstring). `free_bytes`: the device memory free at
    run start (a CPU: the RAM available; None: unknown, nothing checked)."""
    sizes = valid_micro_batches(config)
    assert sizes, "config validation refuses an 'auto' micro-batch with no valid size"
    capped = ""
    if device_type == "cpu" and sizes[-1] > CPU_MAX_MICRO_BATCH:
        sizes = [m for m in sizes if m <= CPU_MAX_MICRO_BATCH] or sizes[:1]
        capped = f"; on a CPU at most {CPU_MAX_MICRO_BATCH}"
    budget = AUTO_HEADROOM * free_bytes if free_bytes else None
    m, planned, refused = largest_fitting(sizes, lambda k: layout_for_config(config, precision, device_type, k),
                                          config.model, config.optim.name, config.data.seq_len, budget)
    where = (f"{AUTO_HEADROOM:.0%} of the {free_bytes / 1e9:.2f} GB free on the {device_type} device"
             if budget is not None else f"the {device_type} device (its free memory unknown: not checked)")
    verdict = "fits" if budget is None or planned <= budget else "does NOT fit (the smallest size: it may run out of memory)"
    reason = (f"auto -> {m}: the largest valid size (of {sizes}{capped}) whose planned peak (lmforge plan's "
              f"memory model) {verdict} in {where}: {planned / 1e9:.2f} GB{refused}")
    return MicroBatchChoice(m, planned, budget, reason)

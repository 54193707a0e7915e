"""Every "auto" of a run's config resolved in one place, once, at run start; then the config is frozen.

    precision, choices = resolve_auto(cfg, device, resumed_from, decides)   # every rank, the same answers
    freeze(cfg)                                         # (lmforge.config.freeze) nothing changes it afterwards
    choices_text(choices)                               # RESOLVED, beside CONFIG (lmforge.folders), and
                                                        # the header's `resolved:` lines (lmforge.train.run_report)

Rank 0 probes the hardware (its device's bf16 units, the memory free, the GPU's compute capability)
and every rank receives its answers (`decides`: Trainer.rank0_decides, a broadcast over the host
group), so every rank computes with the same values. The rules themselves stay where they are
written (lmforge.train.precision, lmforge.plan.micro_batch, lmforge.config.rules); this module
only calls them, in order, and records each key's given value, its value for this run and why:

    train.device          the device of rank 0 (lmforge.parallel.mesh)
    train.precision       the hardware's, or under auto a resumed checkpoint's (lmforge.train.precision)
    train.micro_batch_size  the largest that fits the memory free (lmforge.plan.micro_batch); the one
                          key the run's config carries resolved (its grad_accum_steps follow from it)
    train.compile         per block, the whole model or off (lmforge.config.rules.resolve_compile)
    train.loss_chunk      the fused head's chunk, or 0 (lmforge.config.rules.resolve_loss_chunk)
    data.attention        the document mask's kernel (lmforge.model.documents.document_kernel)
    parallel.dp_shard     inferred from the launch with expert parallelism (lmforge.config.rules)
    checkpoint.resume     the checkpoint the run continues from, if any (lmforge.ckpt.checkpointer)

Where the layouts need these values again (parallelize's compile, the Layout's loss chunk) they call
the same rules on the frozen config, so they read the same answers. Two "auto"s are not one value
per run and stay with their rule: optim.fused (torch's fused kernels for each parameter group where
this torch has them: lmforge.optim.optimizers) and model.moe.grouped_mm (per expert matmul's shapes:
lmforge.model.moe); train.progress = auto is each rank's terminal, shown on rank 0 only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.ckpt.manager import read_meta
from lmforge.config import Config
from lmforge.config.rules import check_resolved_precision, resolve_loss_chunk
from lmforge.train.micro_batch import decide_micro_batch
from lmforge.train.precision import Resolved, resolve_precision
from lmforge.train.progress import is_rank0

log = logging.getLogger("lmforge.train")


@dataclass(frozen=True)
class Choice:
    """One key of the config as this run resolved it."""

    key: str
    given: object  # what the config says
    value: object  # what the run uses
    reason: str

    def line(self) -> str:
        given = "" if self.given == self.value else f"{self.given!r} -> "
        return f"{self.key} = {given}{self.value!r} ({self.reason})"


def decide_precision(cfg: Config, device: torch.device, resumed_from: Path | None, decides) -> Resolved:
    """train.precision resolved on rank 0 for every rank (lmforge.train.precision): from the hardware,
    or under `auto` kept from the checkpoint being resumed; then checked against the layout."""
    resolved = None
    if is_rank0():
        saved = read_meta(resumed_from).get("precision") if resumed_from is not None else None
        resolved = resolve_precision(cfg.train.precision, device, saved)
    resolved = decides(resolved)
    check_resolved_precision(cfg, resolved.name, resolved.reason)
    log.log(logging.WARNING if (resolved.slow or resolved.changed) and is_rank0() else logging.INFO,
            "precision: %s (%s)", resolved.name, resolved.reason)
    return resolved


def resolve_micro_batch(cfg: Config, precision: str, device: torch.device, decides) -> str | None:
    """train.micro_batch_size = "auto" resolved by rank 0 for every rank, from the memory free on its
    device (lmforge.train.micro_batch: the planner's rule, lmforge.plan.micro_batch); logged. The
    config carries the size (set before it is frozen); returns why, or None if it was given."""
    t = cfg.train
    if t.micro_batch_size != "auto":
        return None
    choice = decides(decide_micro_batch(cfg, precision, device) if is_rank0() else None)
    t.micro_batch_size = choice.size
    cfg.validate()
    log.log(logging.INFO if choice.budget_bytes is None or choice.planned_bytes <= choice.budget_bytes
            else logging.WARNING, "train.micro_batch_size: %s", choice.reason)
    return choice.reason


def resolve_auto(cfg: Config, device: torch.device, resumed_from: Path | None,
                 decides) -> tuple[Resolved, list[Choice]]:
    """Every "auto" of `cfg` for this run (module docstring), in the order the run needs them: the
    precision first (the micro-batch's memory depends on it). Every rank calls this."""
    from lmforge.model.documents import document_kernel
    from lmforge.parallel.parallelize import compile_choice

    given_batch = cfg.train.micro_batch_size
    precision = decide_precision(cfg, device, resumed_from, decides)
    why_batch = resolve_micro_batch(cfg, precision.name, device, decides)
    t = cfg.train
    probed = decides((str(device), compile_choice(cfg, device), document_kernel(device.type, cfg.model.dropout)
                      if cfg.data.attention == "document" else None) if is_rank0() else None)  # (one broadcast)
    rank0_device, (compiled, why_compile), kernel = probed
    chunk = resolve_loss_chunk(cfg, device.type, precision.name)
    choices = [Choice("train.device", t.device, rank0_device, "rank 0's device"),
               Choice("train.precision", t.precision, precision.name, precision.reason),
               Choice("train.micro_batch_size", given_batch, t.micro_batch_size, why_batch or "as configured"),
               Choice("train.compile", t.compile, compiled, why_compile),
               Choice("train.loss_chunk", t.loss_chunk, chunk, "lmforge.config.rules.resolve_loss_chunk")]
    if kernel is not None:
        choices.append(Choice("data.attention", "document", f"document ({kernel})", "the document mask's kernel"))
    choices += [Choice("config", "", "", note) for note in cfg.adjustments]  # (load_config fitted these)
    choices.append(Choice("checkpoint.resume", cfg.checkpoint.resume, str(resumed_from) if resumed_from else "none",
                          "the checkpoint this run continues from" if resumed_from else "a fresh start"))
    return precision, choices


def choices_text(choices: list[Choice]) -> str:
    """The file RESOLVED: one `key = value` line per choice (TOML strings), with its given value and why."""
    from lmforge.config.loading import _toml_value

    lines = ["# what this run resolved at start (lmforge.train.auto); beside this file, config.toml: the config",
             "# as given (train.micro_batch_size as resolved: the run's batches follow from it)"]
    for c in choices:
        if c.key == "config":
            lines.append(f"# {c.reason}")
            continue
        lines.append(f"# given {c.given!r}: {c.reason}")
        lines.append(f'"{c.key}" = {_toml_value(c.value if isinstance(c.value, (bool, int, float)) else str(c.value))}')
    return "\n".join(lines) + "\n"

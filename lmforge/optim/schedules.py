"""Learning-rate schedules (indexed by optimizer step) and batch-size ramp-up.

Every schedule starts with a linear warmup, lr = peak * (step + 1) / warmup_steps for
step < warmup_steps (so step 0 already trains and step warmup_steps - 1 reaches the peak), then:

- cosine:   min + (peak - min) * (1 + cos(pi * p)) / 2, p = (step - warmup) / (total - warmup)
- linear:   peak - (peak - min) * p
- constant: peak forever
- wsd:      warmup-stable-decay: peak until the last `decay_fraction` of `total_steps`, then decay
            to min over those steps with `wsd_decay`: "linear" (default), "cosine", or "sqrt"
            (the "1 - sqrt" cool-down: peak - (peak - min) * sqrt(q), q the decay progress).

min = peak * min_lr_ratio. Decaying schedules stay at min for step >= total_steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lmforge.config import ScheduleConfig

SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant", "wsd")
WSD_DECAYS: tuple[str, ...] = ("linear", "cosine", "sqrt")


def _validate(
    schedule: str, peak_lr: float, warmup_steps: int, total_steps: int,
    min_lr_ratio: float, decay_fraction: float, wsd_decay: str,
) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")
    if not peak_lr > 0:
        raise ValueError(f"peak_lr={peak_lr} must be > 0")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must be in [0, total_steps={total_steps})")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if schedule == "wsd":
        if wsd_decay not in WSD_DECAYS:
            raise ValueError(f"wsd_decay={wsd_decay!r} is unknown; use one of {', '.join(WSD_DECAYS)}")
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction={decay_fraction} must be in (0, 1]")
        decay_steps = _wsd_decay_steps(total_steps, decay_fraction)
        if decay_steps < 1 or total_steps - decay_steps < warmup_steps:
            raise ValueError(
                f"decay_fraction={decay_fraction} gives {decay_steps} decay steps out of total_steps="
                f"{total_steps}; it needs >= 1 and must leave warmup_steps={warmup_steps} before the decay"
            )


def _wsd_decay_steps(total_steps: int, decay_fraction: float) -> int:
    """Length of the WSD decay phase: round(decay_fraction * total_steps)."""
    return round(decay_fraction * total_steps)


def lr_at(
    step: int,
    *,
    schedule: str,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
    wsd_decay: str = "linear",
) -> float:
    """The learning rate for optimizer step `step` (0-based). See the module docstring."""
    _validate(schedule, peak_lr, warmup_steps, total_steps, min_lr_ratio, decay_fraction, wsd_decay)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    min_lr = peak_lr * min_lr_ratio
    if step >= total_steps:
        return min_lr
    if schedule == "wsd":
        decay_steps = _wsd_decay_steps(total_steps, decay_fraction)
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return peak_lr
        q = (step - decay_start) / decay_steps
        shape = {"linear": q, "cosine": (1.0 - math.cos(math.pi * q)) / 2, "sqrt": math.sqrt(q)}[wsd_decay]
        return peak_lr - (peak_lr - min_lr) * shape
    p = (step - warmup_steps) / (total_steps - warmup_steps)
    if schedule == "cosine":
        return min_lr + (peak_lr - min_lr) * (1.0 + math.cos(math.pi * p)) / 2
    assert schedule == "linear", schedule
    return peak_lr - (peak_lr - min_lr) * p


@dataclass
class _ScheduleFactor:
    """lr_at(step) / peak_lr as a callable object, so LambdaLR.state_dict() saves its settings."""

    schedule: str
    peak_lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    decay_fraction: float
    wsd_decay: str

    def __call__(self, step: int) -> float:
        return lr_at(
            step, schedule=self.schedule, peak_lr=self.peak_lr, warmup_steps=self.warmup_steps,
            total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio,
            decay_fraction=self.decay_fraction, wsd_decay=self.wsd_decay,
        ) / self.peak_lr


def build_scheduler(cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, peak_lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR setting each group's lr to its base lr * lr_at(step) / peak_lr, the shape from the
    `[schedule]` section (peak_lr = optim.lr, total_steps = train.steps).

    Groups with different base lrs (Muon's matrices vs its AdamW groups) follow the same shape.
    Call `scheduler.step()` after each `optimizer.step()`; the lr used by optimizer step k is
    then base * lr_at(k) / peak_lr.
    """
    factor = _ScheduleFactor(cfg.name, peak_lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, cfg.decay_fraction,
                             cfg.wsd_decay)
    _validate(*dataclasses.astuple(factor))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=factor)


class BatchRampup:
    """Global batch size (in sequences) ramped linearly in tokens, as Megatron's --rampup-batch-size.

    batch_at(tokens) = start + increment * floor((target - start) / increment * tokens / ramp_tokens),
    i.e. the linear ramp from start_batch (at 0 tokens) to target_batch (at ramp_tokens) rounded
    down to the grid start, start + increment, ..., target; target_batch from ramp_tokens on.

    Keeping the LR consistent: `build_scheduler` indexes the LR schedule by optimizer steps, and
    steps during the ramp carry fewer tokens. lmforge's choice is to keep step indexing (simple,
    checkpoint-friendly) and to make warmup cover the ramp. To index the schedule by tokens
    instead, feed `lr_at(equivalent_step(tokens_seen), ...)`: the number of full-batch steps the
    tokens seen so far amount to. Optionally (off by default) scale the lr linearly with the batch
    via `lr_scale_for_batch(batch)` = batch / target_batch when `linear_lr_scaling=True`.
    """

    def __init__(
        self, start_batch: int, target_batch: int, ramp_tokens: int, increment: int, seq_len: int,
        linear_lr_scaling: bool = False,
    ) -> None:
        if start_batch < 1:
            raise ValueError(f"start_batch={start_batch} must be >= 1")
        if target_batch < start_batch:
            raise ValueError(f"target_batch={target_batch} must be >= start_batch={start_batch}")
        if increment < 1 or (target_batch - start_batch) % increment:
            raise ValueError(
                f"increment={increment} must be >= 1 and divide target_batch - start_batch = "
                f"{target_batch - start_batch}"
            )
        if ramp_tokens < 0:
            raise ValueError(f"ramp_tokens={ramp_tokens} must be >= 0")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.start_batch, self.target_batch = start_batch, target_batch
        self.ramp_tokens, self.increment, self.seq_len = ramp_tokens, increment, seq_len
        self.linear_lr_scaling = linear_lr_scaling

    def batch_at(self, tokens_seen: int) -> int:
        """Global batch size (sequences) for the step that starts after `tokens_seen` tokens."""
        if tokens_seen < 0:
            raise ValueError(f"tokens_seen={tokens_seen} must be >= 0")
        if tokens_seen >= self.ramp_tokens:
            return self.target_batch
        n_increments = (self.target_batch - self.start_batch) // self.increment
        done = n_increments * tokens_seen // self.ramp_tokens  # integer floor, no float rounding
        batch = self.start_batch + done * self.increment
        assert self.start_batch <= batch <= self.target_batch
        return batch

    def tokens_in_batch(self, tokens_seen: int) -> int:
        """Tokens the next step consumes: batch_at(tokens_seen) * seq_len."""
        return self.batch_at(tokens_seen) * self.seq_len

    def equivalent_step(self, tokens_seen: int) -> int:
        """Full-batch steps that `tokens_seen` tokens amount to (for token-indexed LR schedules)."""
        return tokens_seen // (self.target_batch * self.seq_len)

    def lr_scale_for_batch(self, batch: int) -> float:
        """batch / target_batch with linear_lr_scaling=True, else 1.0."""
        return batch / self.target_batch if self.linear_lr_scaling else 1.0


def config_batch_rampup(cfg) -> BatchRampup | None:
    """The batch-size ramp-up of a `lmforge.config.Config`'s schedule.batch_rampup_*, or None."""
    s, t = cfg.schedule, cfg.train
    if not s.batch_rampup_start:
        return None
    return BatchRampup(s.batch_rampup_start, t.global_batch_size, s.batch_rampup_tokens,
                       s.batch_rampup_increment or t.micro_batch_size * cfg.parallel.dp, cfg.data.seq_len)

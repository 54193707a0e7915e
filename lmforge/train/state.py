"""The trainer's own checkpointed state, and adapters giving torch objects the checkpoint's
`Stateful` shape (`state_dict()` / `load_state_dict()`, JSON-able). The trainer checkpoints

    {"train": TrainState, "model": ModelOptimizerState, "loader": the loader, "scheduler":
     SchedulerPosition, "scaler": ScalerState, "guard": SpikeGuard, "rng": RNGState}

through lmforge.ckpt.checkpointer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """Where the training loop stands."""

    step: int = 0  # optimizer steps taken (skipped updates included)
    tokens_seen: int = 0
    batches_drawn: int = 0  # step-batches taken from the loader (skipped ones included)
    skip_batches: set[int] = field(default_factory=set)  # batches that rolled the run back: never trained on
    rollbacks: int = 0
    last_loss: float = math.nan
    # the whole run's, over every leg (a resumed run continues them: summary.json counts the run, not
    # the last process): training seconds up to `step` (each leg's time from its first step to its
    # last checkpoint) and the validation loss before the first step
    seconds: float = 0.0
    initial_val_loss: float = math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "batches_drawn": self.batches_drawn,
                "skip_batches": sorted(self.skip_batches), "rollbacks": self.rollbacks, "last_loss": self.last_loss,
                "seconds": self.seconds, "initial_val_loss": self.initial_val_loss}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The position comes from `sd`; what rollbacks learned is kept: the union of the batches to
        skip and the larger rollback count (a rollback reloads an older checkpoint)."""
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.batches_drawn = int(sd.get("batches_drawn", self.step))
        self.skip_batches |= {int(b) for b in sd.get("skip_batches", [])}
        self.rollbacks = max(self.rollbacks, int(sd.get("rollbacks", 0)))
        self.last_loss = float(sd.get("last_loss", math.nan))
        self.seconds = float(sd.get("seconds", 0.0))  # (a checkpoint of an older lmforge: this leg's only)
        self.initial_val_loss = float(sd.get("initial_val_loss", math.nan))


class SchedulerPosition:
    """An LR scheduler's position only. The schedule's shape (steps, base LRs, number of parameter
    groups, which a layout may split) comes from this run's config: LambdaLR's own state dict would
    freeze a resumed run onto the old schedule."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.scheduler.last_epoch, "_step_count": self.scheduler._step_count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch = int(sd["last_epoch"])
        s._step_count = int(sd.get("_step_count", s.last_epoch + 1))
        # the LR of the next step from this run's schedule (the optimizer's saved lr may be stale:
        # ZeRO-1's local optimizer only sees the scheduler's value at its next step)
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs


class ScalerState:
    """torch.amp.GradScaler (fp16 loss scale); a disabled scaler saves and restores nothing."""

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd and self.scaler.is_enabled():
            self.scaler.load_state_dict(sd)

"""Loss-spike and NaN guard: decide, before the optimizer update, whether a step is safe to apply.

A step is skipped (no weight update; the batch is consumed and the step counted, as when a
GradScaler skips an fp16 overflow) when its loss or gradient norm is non-finite, or exceeds the
rolling mean of the last `window` accepted steps by more than `sigma` standard deviations (once
`min_history` steps were accepted; the deviation floor is 5% of the mean, so a flat history does
not flag noise). `rollback_after` consecutive skips ask the trainer to reload the last checkpoint
and skip the offending batches. The verdict depends only on the (all-reduced) loss and the global
grad norm, so every rank decides the same.

`StepGuard` is the guard as the trainer's step uses it: the verdict on the host (one wait per step)
or on the device (torch's fused Adam/AdamW skip on `found_inf`: no host wait, the verdict booked a
step late), the skipped-update events, and the rollback they ask for (`rollback`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    skip: bool
    rollback: bool = False
    reason: str = ""


class SpikeGuard:
    def __init__(self, sigma: float = 6.0, window: int = 100, min_history: int = 20, rollback_after: int = 3):
        self.sigma, self.min_history, self.rollback_after = sigma, min_history, rollback_after
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.consecutive = 0
        self.n_skipped = 0

    def _limit(self, history: deque[float]) -> tuple[float, float]:
        """(mean, the largest value not flagged) of a history; (nan, inf) while it is too short."""
        if self.sigma <= 0 or len(history) < self.min_history:
            return math.nan, math.inf
        mean = sum(history) / len(history)
        std = math.sqrt(sum((v - mean) ** 2 for v in history) / len(history))
        return mean, mean + self.sigma * max(std, 0.05 * abs(mean))

    def limits(self) -> tuple[float, float]:
        """The largest loss and gradient norm the next check accepts (finite values only): a step
        passes `check` exactly when both values are finite and <= these (float64 comparisons)."""
        return self._limit(self.losses)[1], self._limit(self.norms)[1]

    def _outlier(self, value: float, history: deque[float]) -> str | None:
        mean, limit = self._limit(history)
        return f"{value:.4g} > mean {mean:.4g} + {self.sigma:g} sigma ({limit:.4g})" if value > limit else None

    def check(self, loss: float, grad_norm: float) -> Verdict:
        reason = None
        if not math.isfinite(loss):
            reason = f"non-finite loss ({loss})"
        elif not math.isfinite(grad_norm):
            reason = f"non-finite gradient norm ({grad_norm})"
        elif (why := self._outlier(loss, self.losses)) is not None:
            reason = f"loss spike: {why}"
        elif (why := self._outlier(grad_norm, self.norms)) is not None:
            reason = f"gradient-norm spike: {why}"
        if reason is None:
            self.losses.append(loss)
            self.norms.append(grad_norm)
            self.consecutive = 0
            return Verdict(False)
        self.consecutive += 1
        self.n_skipped += 1
        rollback = self.rollback_after > 0 and self.consecutive >= self.rollback_after
        return Verdict(True, rollback, reason)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "consecutive": self.consecutive,
                "n_skipped": self.n_skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.losses.clear()
        self.losses.extend(float(v) for v in sd.get("losses", []))
        self.norms.clear()
        self.norms.extend(float(v) for v in sd.get("norms", []))
        self.consecutive = int(sd.get("consecutive", 0))
        self.n_skipped = int(sd.get("n_skipped", 0))


def can_skip_on_device(optimizer, scaler, async_sgd: bool) -> bool:
    """Can a rejected update be skipped on the device, so that the guard never makes the host wait
    inside a step? Yes for torch's fused Adam / AdamW (their kernels honour `found_inf`: a skipped
    step changes neither the weights nor any state, the step count included) unless fp16's
    GradScaler already drives `found_inf`. Every other optimizer (foreach kernels, ZeRO-1, the
    lmforge optimizers, fp16) keeps the host verdict: one host wait per step, after the backward;
    so does asynchronous SGD's server, which reads every update's values anyway."""
    return not async_sgd and (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
                              and bool(optimizer.defaults.get("fused"))
                              and getattr(optimizer, "_step_supports_amp_scaling", False) and not scaler.is_enabled())


class StepGuard(SpikeGuard):
    """The spike guard of a training run (its checkpointed state: `SpikeGuard`'s). `log_event` writes
    the skipped-update events; `fp16`: an fp16 overflow is the GradScaler's to skip, not a bad step.
    `on_device` (set once the optimizer is known: `Trainer.guard_can_skip_on_device`) chooses the
    device verdict."""

    def __init__(self, cfg, log_event, fp16: bool = False):
        super().__init__(cfg.sigma, cfg.window, cfg.min_history, cfg.rollback_after)
        self.max_rollbacks = cfg.max_rollbacks
        self.log_event, self.fp16, self.on_device = log_event, fp16, False
        self.skipped_batches: list[int] = []  # batch indices of the current run of skipped steps
        self.rollback_requested = False
        self.pending: tuple | None = None  # the last step's (values on the host, step, batch, event)

    def allows(self, loss: float, grad_norm: float, step: int, batch: int) -> bool:
        """The verdict on step `step`, which drew batch `batch` (same on every rank: global loss and norm)."""
        if self.fp16 and math.isfinite(loss) and not math.isfinite(grad_norm):
            return True  # an fp16 overflow: the GradScaler skips the step and lowers its scale
        verdict = self.check(loss, grad_norm)
        if not verdict.skip:
            self.skipped_batches.clear()
            return True
        self.skipped_batches.append(batch)
        self.log_event({"step": step, "event": "skipped_update", "loss": loss, "grad_norm": grad_norm,
                        "batch": batch, "message": f"step {step}: update skipped ({verdict.reason})"})
        self.rollback_requested = verdict.rollback
        return False

    def verdict_on_device(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int, batch: int) -> torch.Tensor:
        """Step `step`'s verdict as a device boolean (True: apply the update), with no host wait.

        The host books the previous step first (`book`: its values were copied to pinned memory a step
        ago, so that wait is normally over), which makes the accepted history what the host check
        would see; then "finite, and <= the history's limits" (`limits`, compared in float64 like
        `check`) is computed on the device. So every verdict is the host check's, booked (events) one
        step late. The host waits for this step's values only where the loop syncs anyway
        (`StepEvents.syncs`), before a checkpoint, and while a bad step would ask for a rollback
        (`rollback_after - 1` skipped steps in a row already; with rollback_after = 1: every step), so
        that a rollback happens at the step the host check asks for it."""
        self.book()
        lim_loss, lim_norm = self.limits()
        if hasattr(grad_norm, "full_tensor"):  # (a DTensor norm: the global value, on every rank)
            grad_norm = grad_norm.full_tensor()
        values = torch.stack([loss.detach().to(torch.float64).reshape(()),
                              grad_norm.detach().to(loss.device, torch.float64).reshape(())])
        ok = torch.isfinite(values).all() & (values[0] <= lim_loss) & (values[1] <= lim_norm)
        event = None
        if values.device.type == "cuda":
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self.pending = (values, step, batch, event)
        if self.rollback_after > 0 and self.consecutive + 1 >= self.rollback_after:
            self.book()  # (a bad step now rolls back: known in this step, as the host check knows it)
        return ok

    def book(self) -> None:
        """Book the verdict of the last step judged on the device (`verdict_on_device`)."""
        if self.pending is None:
            return
        values, step, batch, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        loss, grad_norm = values.tolist()
        self.allows(loss, grad_norm, step, batch)

    def rollback(self, trainer) -> None:
        """Repeated bad steps: reload the trainer's last checkpoint and never train on the offending
        batches again (every rank: the checkpoint load is collective)."""
        bad = list(self.skipped_batches)
        state = trainer.state
        state.skip_batches.update(bad)
        self.skipped_batches.clear()
        self.rollback_requested = False
        self.consecutive = 0
        trainer.ckpt.wait()
        path = trainer.ckpt.latest_valid()
        if path is None:
            self.log_event({"event": "rollback_impossible", "batches": bad,
                            "message": f"{len(bad)} consecutive skipped steps but no checkpoint to roll back to; "
                                       f"going on (set checkpoint.every_steps to enable rollbacks)"})
            return
        state.rollbacks += 1
        if state.rollbacks > self.max_rollbacks:
            raise FloatingPointError(
                f"training rolled back {state.rollbacks - 1} times and still produces bad steps (last batches "
                f"{bad}); lower optim.lr, raise optim.warmup, or use precision = 'bf16'.")
        skipped = self.n_skipped
        trainer.load_checkpoint(path)  # (TrainState keeps the larger rollback count and the union of skips)
        self.n_skipped = skipped
        self.log_event({"event": "rollback", "to_step": state.step, "path": str(path), "skip_batches": bad,
                        "message": f"rolled back to {path.name} (step {state.step}); batches {bad} will be "
                                   f"skipped"})

"""Loss-spike and NaN guard: decide, before the optimizer update, whether a step is safe to apply.

A step is skipped (no weight update; the batch is consumed and the step counted, as when a
GradScaler skips an fp16 overflow) when its loss or gradient norm is non-finite, or exceeds the
rolling mean of the last `window` accepted steps by more than `sigma` standard deviations (once
`min_history` steps were accepted; the deviation floor is 5% of the mean, so a flat history does
not flag noise). `rollback_after` consecutive skips ask the trainer to reload the last checkpoint
and skip the offending batches. The verdict depends only on the (all-reduced) loss and the global
grad norm, so every rank decides the same.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


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

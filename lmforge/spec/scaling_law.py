"""The fitted loss law L(N, D) = E + A / N^alpha + B / D^beta and what it predicts (standard library).

A fit (`lmforge scale fit`, lmforge/scale/fit.py) is written as FIT.json; `lmforge plan --loss FIT.json`
reads it here, without numpy or torch. N counts the model's non-embedding parameters
(`lmforge.model.accounting.count_params(cfg)["non_embedding"]`: Kaplan et al. 2020, who found the
embedding distorts the law of small models; an untied output projection is counted), D the training
tokens, L the final validation loss in nats per token, and compute C = 6 N D (the same N).

Compute-optimal allocation (Hoffmann et al. 2022, eq. 4): minimising L(N, D) subject to 6 N D = C gives
N_opt(C) = G (C / 6)^a and D_opt(C) = (C / 6)^b / G with G = (alpha A / (beta B))^(1 / (alpha + beta)),
a = beta / (alpha + beta), b = alpha / (alpha + beta).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

NAMES = ("E", "A", "B", "alpha", "beta")
FIT_KIND = "lmforge-scaling-law"  # the "kind" of a FIT.json: a file that is not one is refused by name


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta (nats per token; N parameters, D tokens)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def optimal(self, compute: float) -> tuple[float, float]:
        """(N_opt, D_opt) minimising the loss at C = 6 N D = `compute` FLOPs."""
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        return g * (compute / 6) ** (self.beta / s), (compute / 6) ** (self.alpha / s) / g

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between order statistics (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def interval(values: list[float], level: float) -> tuple[float, float]:
    """The central `level` percentile interval of `values` (bootstrap percentile method)."""
    tail = 100 * (1 - level) / 2
    return percentile(values, tail), percentile(values, 100 - tail)


@dataclass
class Prediction:
    """The law's loss at (N, D): the point estimate, the interval of the law (the bootstrap fits'
    losses at (N, D)) and the prediction interval of one more run (each bootstrap loss times each
    residual of the fit: the runs' own scatter about the law added)."""

    n: float
    d: float
    loss: float
    law_interval: tuple[float, float]
    run_interval: tuple[float, float]
    level: float


@dataclass
class Fit:
    """A FIT.json: the law, its bootstrap fits and residuals, and what N, D and L count."""

    law: Law
    bootstrap: list[Law]
    residuals: list[float]  # log(L_run) - log(L_law) of the fitted runs
    level: float
    record: dict  # the whole FIT.json

    @classmethod
    def load(cls, path: str | Path) -> Fit:
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"--loss {str(path)!r}: no such file; write one with `lmforge scale fit RUNS... "
                             f"--out {path}`") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"--loss {str(path)!r} is not readable JSON ({exc}); write it with `lmforge scale "
                             f"fit`") from None
        if not isinstance(record, dict) or record.get("kind") != FIT_KIND:
            raise ValueError(f"--loss {str(path)!r} is not a FIT.json of `lmforge scale fit` (its \"kind\" is not "
                             f"{FIT_KIND!r})")
        return cls(Law(**record["params"]), [Law(**b) for b in record["bootstrap"]], list(record["residuals"]),
                   float(record["level"]), record)

    def predict(self, n: float, d: float) -> Prediction:
        """The loss at N parameters (non-embedding) and D tokens, with its intervals. The run interval
        is over every pair of a bootstrap fit and a residual (the two distributions convolved, no
        random draw)."""
        laws = [b.loss(n, d) for b in self.bootstrap]
        runs = [loss * math.exp(r) for loss in laws for r in self.residuals]
        return Prediction(n, d, self.law.loss(n, d), interval(laws, self.level), interval(runs, self.level),
                          self.level)

    def optimal(self, compute: float) -> dict:
        """The compute-optimal N and D at `compute` FLOPs (C = 6 N D), with bootstrap intervals."""
        n, d = self.law.optimal(compute)
        boot = [b.optimal(compute) for b in self.bootstrap]
        return {"compute": compute, "n_opt": n, "d_opt": d, "loss": self.law.loss(n, d),
                "n_interval": interval([x for x, _ in boot], self.level),
                "d_interval": interval([y for _, y in boot], self.level)}


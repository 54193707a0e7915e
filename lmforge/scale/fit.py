"""Fitting L(N, D) = E + A / N^alpha + B / D^beta to runs: Chinchilla's approach 3 (Hoffmann et al.
2022, section 3.3 and appendix D.2), with bootstrap confidence intervals.

The law is fitted in its log-sum-exp form, log L = LSE(a - alpha log N, b - beta log D, e) with
A = exp(a), B = exp(b), E = exp(e), by minimising the Huber loss (delta = 1e-3) of the log-loss residuals
with L-BFGS (scipy's L-BFGS-B, analytic gradient) from a grid of initialisations: Hoffmann et al.'s
alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25}. The objective is
evaluated at every grid point at once (numpy), and L-BFGS starts from the `starts` best of them; the best
local minimum wins. (Hoffmann et al. run L-BFGS from every grid point; from the best few it finds the
same minimum on the published laws' points at a fraction of the cost: tests/test_scale_fit.py.)

Bootstrap: the runs are resampled with replacement `n_boot` times and each resample refitted (from the
full fit's optimum and the full data's `boot_starts` best grid points); the interval of a parameter, or of anything
computed from one (a prediction, the compute-optimal N and D), is the percentile interval over the
refits. numpy and scipy are imported here only; lmforge/spec/scaling_law.py reads the result without them.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np


def _import_minimize():
    """scipy's `minimize`, its OpenBLAS (scipy's own copy, loaded with scipy.optimize) started with one
    thread: L-BFGS-B on a 5-vector ran 8x slower with OpenBLAS's thread pool on a busy 2-core machine
    (5 s instead of 0.6 s a fit). OpenBLAS reads the variable when it loads; it is restored after."""
    before = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        from scipy.optimize import minimize
    finally:
        if before is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = before
    return minimize


minimize = _import_minimize()

from lmforge.spec.scaling_law import FIT_KIND, NAMES, Fit, Law, interval

HUBER_DELTA = 1e-3
GRID = {"a": np.arange(0, 26, 5.0), "b": np.arange(0, 26, 5.0), "e": np.arange(-1, 1.01, 0.5),
        "alpha": np.arange(0, 2.01, 0.5), "beta": np.arange(0, 2.01, 0.5)}
# the optimiser's vector: (a, b, e, alpha, beta)
_GRID_POINTS = np.array(list(itertools.product(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"])))


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    """Huber's loss: r^2 / 2 within delta, delta (|r| - delta / 2) beyond (elementwise)."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _predicted_log_loss(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray) -> tuple[np.ndarray, list]:
    """log L for parameter rows `theta` [K, 5] at every point [P]: ([K, P], the three LSE terms' softmax
    weights, each [K, P])."""
    a, b, e, alpha, beta = (theta[:, i:i + 1] for i in range(5))
    terms = (a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (theta.shape[0], log_n.size)))
    top = np.maximum(np.maximum(terms[0], terms[1]), terms[2])
    exps = [np.exp(t - top) for t in terms]
    total = exps[0] + exps[1] + exps[2]
    return top + np.log(total), [x / total for x in exps]


def objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
              delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """The Huber objective (summed over points, / delta so that it is O(1) per point) of each row of
    `theta` [K, 5], and its gradient [K, 5]."""
    pred, w = _predicted_log_loss(theta, log_n, log_d)
    r = pred - log_l
    value = huber(r, delta).sum(-1) / delta
    dr = np.clip(r, -delta, delta) / delta  # dHuber/dr / delta
    grad = np.stack([(dr * w[0]).sum(-1), (dr * w[1]).sum(-1), (dr * w[2]).sum(-1),
                     -(dr * w[0] * log_n).sum(-1), -(dr * w[1] * log_d).sum(-1)], -1)
    return value, grad


def _lbfgs(x0: np.ndarray, data: tuple[np.ndarray, ...]) -> tuple[float, np.ndarray]:
    def f(x):
        v, g = objective(x[None], *data)
        return float(v[0]), g[0]

    res = minimize(f, x0, jac=True, method="L-BFGS-B",
                   options={"maxiter": 5000, "maxcor": 20, "ftol": 1e-15, "gtol": 1e-12})
    return float(res.fun), res.x


def best_grid_points(data: tuple[np.ndarray, ...], k: int) -> np.ndarray:
    """The `k` initialisations of the grid with the lowest objective on `data` [k, 5]."""
    values, _ = objective(_GRID_POINTS, *data)
    return _GRID_POINTS[np.argsort(values, kind="stable")[:k]]


def _fit_theta(data: tuple[np.ndarray, ...], starts: np.ndarray) -> np.ndarray:
    """The best local minimum of L-BFGS started from each row of `starts`."""
    return min((_lbfgs(x0, data) for x0 in starts), key=lambda fx: fx[0])[1]


def _law(theta: np.ndarray) -> Law:
    a, b, e, alpha, beta = (float(v) for v in theta)
    return Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


@dataclass
class FitResult:
    law: Law
    bootstrap: list[Law]
    residuals: list[float]
    level: float

    def interval(self, name: str) -> tuple[float, float]:
        return interval([getattr(b, name) for b in self.bootstrap], self.level)


def fit_law(n: np.ndarray, d: np.ndarray, loss: np.ndarray, n_boot: int = 200, level: float = 0.95,
            starts: int = 32, boot_starts: int = 2, seed: int = 0) -> FitResult:
    """Fit the law to points (N, D, L) and bootstrap it (`n_boot` resamples of the points; 0: none)."""
    n, d, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, loss))
    if not (n.shape == d.shape == loss.shape and n.ndim == 1):
        raise ValueError("fit: N, D and L must be 1-D arrays of the same length")
    if n.size < len(NAMES):
        raise ValueError(f"fit: {n.size} runs cannot determine the law's {len(NAMES)} parameters; give at least "
                         f"{len(NAMES)} (an IsoFLOP grid of a few sizes at each of a few budgets: `lmforge scale sweep`)")
    if np.any(n <= 0) or np.any(d <= 0) or np.any(loss <= 0) or not np.all(np.isfinite(loss)):
        raise ValueError("fit: every run needs N > 0, D > 0 and a finite loss > 0")
    data = (np.log(n), np.log(d), np.log(loss))
    grid_best = best_grid_points(data, starts)
    theta = _fit_theta(data, grid_best)
    pred, _ = _predicted_log_loss(theta[None], data[0], data[1])
    residuals = (data[2] - pred[0]).tolist()
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_boot):
        idx = rng.integers(0, n.size, n.size)
        sample = tuple(x[idx] for x in data)
        boot.append(_law(_fit_theta(sample, np.vstack([theta[None], grid_best[:boot_starts]]))))
    return FitResult(_law(theta), boot, residuals, level)


def fit_record(result: FitResult, points: list[dict], budgets: list[float], what: dict) -> dict:
    """The FIT.json of a fit: the law, its intervals, the bootstrap fits and residuals (what
    lmforge.spec.scaling_law.Fit reads back), the runs, and the compute-optimal N and D per budget."""
    record = {
        "kind": FIT_KIND,
        "law": "L(N, D) = E + A / N^alpha + B / D^beta",
        "params": result.law.as_dict(),
        "level": result.level,
        "intervals": {name: list(result.interval(name)) for name in NAMES},
        "method": {"approach": "Hoffmann et al. 2022 approach 3: Huber loss on log L, LSE parametrisation, "
                               "L-BFGS-B from a grid of initialisations; percentile bootstrap over runs",
                   "huber_delta": HUBER_DELTA, "bootstrap": len(result.bootstrap)},
        **what,
        "runs": points,
        "residuals": result.residuals,
        "bootstrap": [b.as_dict() for b in result.bootstrap],
    }
    fit = Fit(result.law, result.bootstrap, result.residuals, result.level, record)
    record["compute_optimal"] = [fit.optimal(c) for c in budgets]
    return record

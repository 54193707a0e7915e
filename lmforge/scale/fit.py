"""Fitting L(N, D) = E + A / N^alpha + B / D^beta to runs: Chinchilla's approach 3 (Hoffmann et al.
2022, section 3.3 and appendix D.2), with bootstrap confidence intervals.

The law is fitted in its log-sum-exp form, log L = LSE(a - alpha log N, b - beta log D, e) with
A = exp(a), B = exp(b), E = exp(e), by minimising the Huber loss (delta = 1e-3) of the log-loss residuals
with a quasi-Newton method (BFGS, analytic gradient, weak-Wolfe line search) from a grid of
initialisations: Hoffmann et al.'s alpha, beta in {0, 0.5, ..., 2}, e in {-1, -0.5, ..., 1}, a, b in
{0, 5, ..., 25}. The objective is evaluated at every grid point at once (numpy), and BFGS starts from the
`starts` best of them; the best local minimum wins. (Hoffmann et al. run L-BFGS from every grid point;
from the best few it finds the same minimum on the published laws' points at a fraction of the cost:
tests/test_scale_fit.py. With 5 parameters BFGS keeps the whole 5 x 5 inverse Hessian, which is what
L-BFGS's memory of pairs approximates.)

Bootstrap: the runs are resampled with replacement `n_boot` times and each resample refitted (from the
full fit's optimum and the full data's `boot_starts` best grid points); the interval of a parameter, or of
anything computed from one (a prediction, the compute-optimal N and D), is the percentile interval over
the refits. All the minimisations of one stage (the starts of the full fit; then every start of every
resample) run as one batch in `_bfgs`, every row its own problem, so that a step costs a few numpy calls
for all of them together. numpy is imported here only; lmforge/spec/scaling_law.py reads the result
without it.

Until 2026-11 every start was its own call of scipy's L-BFGS-B (maxcor 20; this module's ftol and gtol),
13.5 s of CPU for a 200-resample fit of 20 runs, nearly all of it per-call overhead; the batch finds the
same minima in ~1 s (benchmarks/RESULTS.md: the comparison, and the speed-up).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

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
    """log L for parameter rows `theta` [K, 5] at every point ([P], or [K, P]: a set of points per row):
    ([K, P], the three LSE terms' softmax weights, each [K, P])."""
    a, b, e, alpha, beta = (theta[:, i:i + 1] for i in range(5))
    terms = (a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, np.broadcast_shapes(a.shape, log_n.shape)))
    top = np.maximum(np.maximum(terms[0], terms[1]), terms[2])
    exps = [np.exp(t - top) for t in terms]
    total = exps[0] + exps[1] + exps[2]
    return top + np.log(total), [x / total for x in exps]


def objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
              delta: float = HUBER_DELTA) -> tuple[np.ndarray, np.ndarray]:
    """The Huber objective (summed over points, / delta so that it is O(1) per point) of each row of
    `theta` [K, 5], and its gradient [K, 5]; the points [P] are the same for every row, or [K, P] a set per row."""
    pred, w = _predicted_log_loss(theta, log_n, log_d)
    r = pred - log_l
    value = huber(r, delta).sum(-1) / delta
    dr = np.clip(r, -delta, delta) / delta  # dHuber/dr / delta
    g_a, g_b = dr * w[0], dr * w[1]
    grad = np.stack([g_a.sum(-1), g_b.sum(-1), (dr * w[2]).sum(-1), -(g_a * log_n).sum(-1), -(g_b * log_d).sum(-1)], -1)
    return value, grad


def _rows(data: tuple[np.ndarray, ...], rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """The points of problems `rows`: data [1, P] is every problem's, [K, P] one row each."""
    return tuple(x if x.shape[0] == 1 else x[rows] for x in data)


def _wolfe_step(x: np.ndarray, f: np.ndarray, g: np.ndarray, p: np.ndarray, t: np.ndarray,
                data: tuple[np.ndarray, ...], c1: float = 1e-4, c2: float = 0.9,
                tries: int = 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step along each row's direction p (downhill) from its first try t: the first try that meets
    Armijo's condition f(x + tp) <= f + c1 t g.p and the weak Wolfe condition g(x + tp).p >= c2 g.p
    (Lewis & Overton 2013's line search for BFGS on functions that are not smooth, as the Huber loss
    with a small delta nearly is not): a step too long is cut to the minimum of the quadratic through
    f, g.p and the new value (kept within 0.1-0.5 of it), or halved once a shorter step met Armijo's
    condition; a step too short is doubled. A row that meets both within `tries` (L-BFGS-B's 20) takes
    its lowest point below f, or none (step 0). (step, f, g) per row."""
    slope = (g * p).sum(1)
    lo, hi = np.zeros_like(t), np.full_like(t, np.inf)
    step, f_new, g_new = np.zeros_like(t), f.copy(), g.copy()
    todo = np.arange(len(x))
    for _ in range(tries):
        tt, f0, s0 = t[todo], f[todo], slope[todo]
        ft, gt = objective(x[todo] + tt[:, None] * p[todo], *_rows(data, todo))
        armijo = ft <= f0 + c1 * tt * s0
        ok = armijo & ((gt * p[todo]).sum(1) >= c2 * s0)
        better = (ft < f_new[todo]) | ok
        take = todo[better]
        step[take], f_new[take], g_new[take] = tt[better], ft[better], gt[better]
        hi[todo[~armijo]] = tt[~armijo]
        lo[todo[armijo]] = tt[armijo]
        with np.errstate(divide="ignore", invalid="ignore"):
            quadratic = -s0 * tt * tt / (2 * (ft - f0 - s0 * tt))
        cut = np.clip(np.where(np.isfinite(quadratic), quadratic, 0.5 * tt), 0.1 * tt, 0.5 * tt)
        tl, th = lo[todo], hi[todo]
        t[todo] = np.where(np.isinf(th), 2 * tl, np.where(tl > 0, 0.5 * (tl + th), cut))
        todo = todo[~ok]
        if todo.size == 0:
            break
    return step, f_new, g_new


def _bfgs(x0: np.ndarray, data: tuple[np.ndarray, ...], maxiter: int = 5000, ftol: float = 1e-15,
          gtol: float = 1e-12) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the objective from each row of `x0` [K, 5], every row its own problem (its points: row
    k of `data`'s [K, P] arrays, or the [1, P] arrays for all): BFGS with the inverse Hessian [K, 5, 5],
    scaled by s.y / y.y before its first update (Nocedal & Wright (6.20)), the first step of length
    at most 1 (L-BFGS-B's), and a weak-Wolfe line search. A row stops when its gradient is below
    `gtol` (max norm), its objective falls by at most `ftol` x max(|f|, 1) in a step (L-BFGS-B's tests,
    with this module's tolerances from when it ran L-BFGS-B), or its line search finds no lower point
    from a fresh (identity) inverse Hessian; a failed search with an updated one restarts from the
    identity. (minimum value [K], argmin [K, 5].)

    Why a hand-written solver: the problems are tiny (5 parameters, tens of points) and there are
    hundreds of them (200 bootstrap resamples x 3 starts); scipy.optimize's minimisers take one problem
    a call and their per-iteration overhead was nearly all the time (L-BFGS-B: 13.5 s for a 200-resample
    fit; driving its reverse-communication routine for every problem in lock-step, identical results,
    still 3 s); least_squares(loss='huber', f_scale=delta), the same objective with a Gauss-Newton model,
    needs 150-1500 evaluations per start here (with delta 1e-3 most residuals are past delta, where that
    model has no curvature), and trust-exact with the exact Hessian 230-420 iterations, as many as
    L-BFGS-B (the kinks of the Huber loss, not the curvature, set the pace). Batched minimisers (jaxopt,
    optimistix under vmap) would need jax; torch.optim.LBFGS minimises one problem (one line search for
    all rows)."""
    x = np.array(x0, dtype=np.float64)
    f, g = objective(x, *data)
    out_f, out_x = f.copy(), x.copy()
    ids = np.arange(len(x))
    h = np.tile(np.eye(5), (len(x), 1, 1))
    fresh = np.ones(len(x), dtype=bool)

    def keep(rows):
        nonlocal ids, x, f, g, h, fresh, data
        ids, x, f, g, h, fresh = ids[rows], x[rows], f[rows], g[rows], h[rows], fresh[rows]
        data = _rows(data, rows)

    keep(np.abs(g).max(1) > gtol)
    for _ in range(maxiter):
        if ids.size == 0:
            break
        p = -np.einsum("kij,kj->ki", h, g)
        uphill = (p * g).sum(1) >= 0  # the inverse Hessian lost its positive definiteness to rounding
        if uphill.any():
            h[uphill], p[uphill], fresh[uphill] = np.eye(5), -g[uphill], True
        first = np.where(fresh, np.minimum(1.0, 1.0 / np.sqrt((p * p).sum(1))), 1.0)
        step, f_new, g_new = _wolfe_step(x, f, g, p, first, data)
        moved = step > 0
        s, y = step[:, None] * p, g_new - g
        sy = (s * y).sum(1)
        update = moved & (sy > np.finfo(np.float64).eps * -step * (p * g).sum(1))  # L-BFGS-B's skip rule
        if update.any():
            hu, su, yu, syu = h[update], s[update], y[update], sy[update]
            scale = fresh[update]
            hu[scale] = np.eye(5) * (syu[scale] / (yu[scale] ** 2).sum(1))[:, None, None]
            hy = np.einsum("kij,kj->ki", hu, yu)
            rho = 1.0 / syu
            c = rho * (1.0 + rho * (yu * hy).sum(1))
            h[update] = (hu - rho[:, None, None] * (su[:, :, None] * hy[:, None, :] + hy[:, :, None] * su[:, None, :])
                         + c[:, None, None] * su[:, :, None] * su[:, None, :])
        stuck = ~moved & fresh
        h[~moved], fresh[~moved] = np.eye(5), True  # a failed line search: again from the identity
        fresh[update] = False
        drop = f - f_new
        x[moved], f[moved], g[moved] = x[moved] + s[moved], f_new[moved], g_new[moved]
        out_f[ids], out_x[ids] = f, x
        done = stuck | (moved & ((np.abs(g).max(1) <= gtol)
                                 | (drop <= ftol * np.maximum(np.maximum(np.abs(f), np.abs(f + drop)), 1.0))))
        if done.any():
            keep(~done)
    return out_f, out_x


def best_grid_points(data: tuple[np.ndarray, ...], k: int) -> np.ndarray:
    """The `k` initialisations of the grid with the lowest objective on `data` [k, 5]."""
    values, _ = objective(_GRID_POINTS, *data)
    return _GRID_POINTS[np.argsort(values, kind="stable")[:k]]


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
    values, thetas = _bfgs(grid_best, tuple(x[None] for x in data))
    theta = thetas[np.argmin(values)]  # the best local minimum (the first of equals)
    pred, _ = _predicted_log_loss(theta[None], data[0], data[1])
    residuals = (data[2] - pred[0]).tolist()
    rng = np.random.default_rng(seed)
    resamples = np.array([rng.integers(0, n.size, n.size) for _ in range(n_boot)], dtype=np.int64).reshape(n_boot, n.size)
    boot_from = np.vstack([theta[None], grid_best[:boot_starts]])
    k = len(boot_from)
    values, thetas = _bfgs(np.tile(boot_from, (n_boot, 1)), tuple(np.repeat(x[resamples], k, axis=0) for x in data))
    best = np.argmin(values.reshape(n_boot, k), axis=1)
    boot = [_law(t) for t in thetas.reshape(n_boot, k, 5)[np.arange(n_boot), best]]
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
                               "BFGS from a grid of initialisations; percentile bootstrap over runs",
                   "huber_delta": HUBER_DELTA, "bootstrap": len(result.bootstrap)},
        **what,
        "runs": points,
        "residuals": result.residuals,
        "bootstrap": [b.as_dict() for b in result.bootstrap],
    }
    fit = Fit(result.law, result.bootstrap, result.residuals, result.level, record)
    record["compute_optimal"] = [fit.optimal(c) for c in budgets]
    return record

"""The scaling-law fit (lmforge/scale/fit.py, Hoffmann et al.'s approach 3) recovers published laws from
points drawn on an IsoFLOP grid with noise, and what it writes (FIT.json) predicts through
`lmforge plan --loss`.

The grid: Chinchilla's budgets (6e18 to 3e21 FLOPs, Hoffmann et al. figure 3), at each 9 model sizes from
1/10 to 10x the law's compute-optimal N, D = C / (6N); each loss times exp(eps), eps ~ N(0, 1%)
(log-normal noise of 1%, seed 0). Tolerances, from the spread of the bootstrap fits at this noise: E
within 0.06 nats, alpha and beta within 0.025, A and B within a factor of 1.5 (A and B move with alpha and
beta: log A shifts by ~log N x the error of alpha); and each true value inside its 95% bootstrap interval.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmforge.scale.fit import _bfgs, _law, best_grid_points, fit_law, fit_record, objective
from lmforge.spec.scaling_law import Fit, Law

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {
    "hoffmann2022": Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28),
    "epoch2024": Law(E=1.82, A=482.0, B=2085.4, alpha=0.348, beta=0.366),
}
BUDGETS = [6e18, 1e19, 3e19, 6e19, 1e20, 3e20, 6e20, 1e21, 3e21]
NOISE = 0.01


def isoflop_points(law: Law, noise: float = NOISE, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    n, d, loss = [], [], []
    for c in BUDGETS:
        n_opt, _ = law.optimal(c)
        for k in np.linspace(-1, 1, 9):
            size = n_opt * 10 ** k
            n.append(size)
            d.append(c / (6 * size))
            loss.append(law.loss(size, c / (6 * size)) * math.exp(rng.normal(0, noise)))
    return np.array(n), np.array(d), np.array(loss)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_fit_recovers_a_published_law_from_noisy_isoflop_points(name):
    true = PUBLISHED[name]
    result = fit_law(*isoflop_points(true), n_boot=100)
    got = result.law
    print(f"\n{name}: fitted {got}")
    assert abs(got.E - true.E) < 0.06, (got, true)
    assert abs(got.alpha - true.alpha) < 0.025 and abs(got.beta - true.beta) < 0.025, (got, true)
    assert abs(math.log(got.A / true.A)) < math.log(1.5) and abs(math.log(got.B / true.B)) < math.log(1.5), (got, true)
    for param in ("E", "A", "B", "alpha", "beta"):
        lo, hi = result.interval(param)
        print(f"  {param}: true {getattr(true, param)}, fitted {getattr(got, param):.4g}, 95% [{lo:.4g}, {hi:.4g}]")
        assert lo <= getattr(true, param) <= hi, (param, lo, hi)


def test_without_noise_the_fit_is_exact():
    """On exact points the minimum is the law itself (to the optimiser's tolerance)."""
    true = PUBLISHED["epoch2024"]
    got = fit_law(*isoflop_points(true, noise=0.0), n_boot=0).law
    for param in ("E", "A", "B", "alpha", "beta"):
        assert math.isclose(getattr(got, param), getattr(true, param), rel_tol=2e-3), (param, got)


def test_the_objective_gradient_is_the_derivative_of_the_objective():
    n, d, loss = isoflop_points(PUBLISHED["hoffmann2022"])
    data = (np.log(n), np.log(d), np.log(loss))
    theta = np.array([[6.0, 6.0, 0.5, 0.35, 0.3]])
    _, grad = objective(theta, *data)
    for i in range(5):
        step = np.zeros((1, 5))
        step[0, i] = 1e-7
        numeric = (objective(theta + step, *data)[0] - objective(theta - step, *data)[0]) / 2e-7
        assert math.isclose(grad[0, i], numeric[0], rel_tol=1e-4, abs_tol=1e-6), (i, grad, numeric)


def _resamples(data: tuple[np.ndarray, ...], count: int) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(1)
    return [tuple(x[idx] for x in data) for idx in (rng.integers(0, data[0].size, data[0].size) for _ in range(count))]


def test_each_row_of_a_batch_is_its_own_problem():
    """fit_law minimises all starts of all bootstrap resamples as one batch: each row ends where it ends
    when minimised alone."""
    n, d, loss = isoflop_points(PUBLISHED["hoffmann2022"])
    data = (np.log(n), np.log(d), np.log(loss))
    starts = best_grid_points(data, 3)
    samples = _resamples(data, 4)
    batch_f, batch_x = _bfgs(np.tile(starts, (len(samples), 1)),
                             tuple(np.repeat(np.stack(col), len(starts), axis=0) for col in zip(*samples)))
    for i, sample in enumerate(samples):
        alone_f, alone_x = _bfgs(starts, tuple(x[None] for x in sample))
        np.testing.assert_allclose(batch_f[3 * i:3 * i + 3], alone_f, rtol=1e-12)
        np.testing.assert_allclose(batch_x[3 * i:3 * i + 3], alone_x, rtol=1e-12, atol=1e-12)


def test_the_batched_bfgs_finds_the_minimum_scipys_lbfgsb_finds():
    """The fit ran scipy's L-BFGS-B from each start until the batched BFGS replaced it: on the published
    law's points and on resamples of them, the best minimum of the same starts predicts the same losses."""
    minimize = pytest.importorskip("scipy.optimize").minimize
    n, d, loss = isoflop_points(PUBLISHED["epoch2024"])
    data = (np.log(n), np.log(d), np.log(loss))
    starts = best_grid_points(data, 8)
    for sample in [data, *_resamples(data, 3)]:
        values, thetas = _bfgs(starts, tuple(x[None] for x in sample))
        ours = thetas[np.argmin(values)]
        runs = [minimize(lambda x: tuple(v[0] for v in objective(x[None], *sample)), x0, jac=True, method="L-BFGS-B",
                         options={"maxiter": 5000, "maxcor": 20, "ftol": 1e-15, "gtol": 1e-12}) for x0 in starts]
        theirs = min(runs, key=lambda r: r.fun)
        assert values.min() <= theirs.fun * (1 + 1e-9)
        for size, tokens in ((1e7, 1e9), (1e9, 2e10), (1e11, 1e13)):
            assert _law(ours).loss(size, tokens) == pytest.approx(_law(theirs.x).loss(size, tokens), rel=1e-6)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_compute_optimal_closed_form_is_the_minimum_along_the_isoflop(name):
    law = PUBLISHED[name]
    for c in (1e18, 5.76e23):
        n_opt, d_opt = law.optimal(c)
        assert math.isclose(6 * n_opt * d_opt, c, rel_tol=1e-9)
        sizes = n_opt * np.exp(np.linspace(-2, 2, 40001))
        best = sizes[np.argmin([law.loss(s, c / (6 * s)) for s in sizes])]
        assert math.isclose(best, n_opt, rel_tol=1e-3), (c, best, n_opt)


def test_fit_json_round_trip_predicts_with_intervals(tmp_path):
    true = PUBLISHED["hoffmann2022"]
    n, d, loss = isoflop_points(true)
    result = fit_law(n, d, loss, n_boot=30)
    points = [{"run": f"r{i}", "n_params": float(a), "tokens": float(b), "loss": float(c)} for i, (a, b, c)
              in enumerate(zip(n, d, loss))]
    path = tmp_path / "FIT.json"
    path.write_text(json.dumps(fit_record(result, points, [1e20], {})))
    fit = Fit.load(path)
    p = fit.predict(1e9, 2e10)
    assert p.loss == pytest.approx(result.law.loss(1e9, 2e10))
    assert p.run_interval[0] <= p.law_interval[0] <= p.loss <= p.law_interval[1] <= p.run_interval[1]
    row = fit.record["compute_optimal"][0]
    assert row["n_opt"] == pytest.approx(result.law.optimal(1e20)[0])
    assert row["n_interval"][0] <= row["n_opt"] <= row["n_interval"][1]
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a FIT.json"):
        Fit.load(tmp_path / "other.json")


def _fake_run(folder: Path, dim: int, layers: int, steps: int, law: Law) -> tuple[int, int]:
    """A finished run folder of the tiny family (config.toml + summary.json) whose loss is `law`'s."""
    from lmforge.config import load_config, to_toml
    from lmforge.model.accounting import count_params

    cfg = load_config("tiny", {"model.dim": dim, "model.n_layers": layers, "model.n_heads": dim // 32,
                               "train.steps": steps})
    n = count_params(cfg.model)["non_embedding"]
    tokens = steps * cfg.train.global_batch_size * cfg.data.seq_len
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(to_toml(cfg))
    (folder / "summary.json").write_text(json.dumps({"steps": steps, "tokens": tokens, "val_loss": law.loss(n, tokens)}))
    return n, tokens


def test_scale_fit_and_plan_loss_through_the_command_line(tmp_path):
    """`lmforge scale fit` on run folders whose losses follow a law finds it; `lmforge plan --loss` then
    prints the law's loss for the planned run's N and D and the compute-optimal N for its budget."""
    law = Law(E=1.5, A=80.0, B=300.0, alpha=0.3, beta=0.35)
    for i, (dim, layers) in enumerate([(32, 1), (64, 2), (96, 3), (128, 4), (192, 4)]):
        for steps in (20, 60, 200):
            _fake_run(tmp_path / "sweep" / f"t{i}-{steps}", dim, layers, steps, law)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "lmforge", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=tmp_path, env=env, timeout=300)
    proc = run("scale", "fit", "sweep", "--bootstrap", "20", "--plot", "isoflop.png")
    assert proc.returncode == 0, proc.stderr
    assert "compute-optimal" in proc.stdout and (tmp_path / "isoflop.png").stat().st_size > 10_000
    fit = Fit.load(tmp_path / "FIT.json")
    assert len(fit.record["runs"]) == 15
    proc = run("plan", "--model", "tiny", "--gpus", "1xH100", "--tokens", "1e6", "--loss", "FIT.json")
    assert proc.returncode == 0, proc.stderr
    from lmforge.config import load_config
    from lmforge.model.accounting import count_params

    n = count_params(load_config("tiny").model)["non_embedding"]
    assert f"predicted final validation loss {law.loss(n, 1e6):.4f}" in proc.stdout, proc.stdout
    n_opt = law.optimal(6 * n * 1e6)[0]
    assert f"N = {n_opt:,.0f}" in proc.stdout, proc.stdout
    proc = run("plan", "--model", "tiny", "--gpus", "1xH100", "--tokens", "1e6", "--loss", "FIT.json", "--json")
    pred = json.loads(proc.stdout)["loss"]
    assert pred["predicted"] == pytest.approx(law.loss(n, 1e6), rel=1e-4) and pred["n_params"] == n
    proc = run("plan", "--model", "tiny", "--gpus", "1xH100", "--loss", "missing.json")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_scale_fit_refuses_too_few_runs(tmp_path):
    law = Law(E=1.5, A=80.0, B=300.0, alpha=0.3, beta=0.35)
    for i, dim in enumerate((32, 64)):
        _fake_run(tmp_path / f"r{i}", dim, 1, 20, law)
    proc = subprocess.run([sys.executable, "-m", "lmforge", "scale", "fit", "r0", "r1"], cwd=tmp_path, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 2 and "2 runs cannot determine" in proc.stderr, proc.stderr
    # no resamples, no intervals: refused up front (it failed with an IndexError after the fit)
    proc = subprocess.run([sys.executable, "-m", "lmforge", "scale", "fit", "r0", "r1", "--bootstrap", "0"],
                          cwd=tmp_path, text=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=120)
    assert proc.returncode == 2 and "--bootstrap 0 must be an integer >= 2" in proc.stderr, proc.stderr

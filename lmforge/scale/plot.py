"""The IsoFLOP plot of a fit: each budget's runs (loss against N), the fitted law along each budget's
curve D = C / (6 N), its compute-optimal N, and held-out runs with their prediction intervals."""

from __future__ import annotations

import math
from pathlib import Path

from lmforge.report.plots import _pyplot
from lmforge.spec.scaling_law import Fit


def plot_fit(fit: Fit, budgets: list[float], path: Path, held_out: list[dict] = ()) -> Path:
    plt = _pyplot()
    runs = fit.record["runs"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    cmap = plt.get_cmap("viridis")
    ns = [r["n_params"] for r in runs] + [h["n_params"] for h in held_out] + [fit.law.optimal(c)[0] for c in budgets]
    lo, hi = math.log(min(ns) / 2), math.log(max(ns) * 2)
    for i, c in enumerate(budgets):
        color = cmap(i / max(1, len(budgets) - 1))
        mine = [r for r in runs if _budget_of(r["flops"], budgets) == c]
        ax.scatter([r["n_params"] for r in mine], [r["loss"] for r in mine], color=color, zorder=3,
                   label=f"C = {c:.2g}")
        grid = [math.exp(lo + (hi - lo) * k / 99) for k in range(100)]
        ax.plot(grid, [fit.law.loss(n, c / (6 * n)) for n in grid], color=color, lw=1, alpha=0.8)
        n_opt, d_opt = fit.law.optimal(c)
        ax.scatter([n_opt], [fit.law.loss(n_opt, d_opt)], marker="*", s=120, color=color, edgecolor="k", zorder=4)
    for c in sorted({float(f"{6 * h['n_params'] * h['tokens']:.2g}") for h in held_out}):  # their budgets' law
        grid = [math.exp(lo + (hi - lo) * k / 99) for k in range(100)]
        ax.plot(grid, [fit.law.loss(n, c / (6 * n)) for n in grid], color="tab:red", lw=1, ls="--", alpha=0.7,
                label=f"law at C = {c:.2g} (held out)")
    for i, h in enumerate(held_out):
        p = fit.predict(h["n_params"], h["tokens"])
        ax.errorbar([h["n_params"]], [p.loss], yerr=[[p.loss - p.run_interval[0]], [p.run_interval[1] - p.loss]],
                    fmt="s", color="tab:red", mfc="none", capsize=4, zorder=4,
                    label=None if i else f"held out: predicted ({p.level:.0%} interval, one run)")
        ax.scatter([h["n_params"]], [h["loss"]], marker="x", s=80, color="tab:red", zorder=5,
                   label=None if i else "held out: measured")
    ax.set_xscale("log")
    ax.set_xlabel("N (non-embedding parameters)")
    ax.set_ylabel("final validation loss (nats/token)")
    law = fit.law
    ax.set_title(f"L = {law.E:.2f} + {law.A:.3g}/N^{law.alpha:.2f} + {law.B:.3g}/D^{law.beta:.2f}   "
                 f"(stars: compute-optimal N)", fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _budget_of(flops: float, budgets: list[float]) -> float:
    """The budget nearest (in log) to a run's 6ND."""
    return min(budgets, key=lambda c: abs(math.log(flops / c)))

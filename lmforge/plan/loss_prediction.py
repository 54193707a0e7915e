"""`lmforge plan --loss FIT.json`: the planned run's final loss from a fitted scaling law
(`lmforge scale fit`), and the compute-optimal size for the run's compute budget.

The run's N is its non-embedding parameter count (as the fit's: lmforge/spec/scaling_law.py), D its training
tokens (--tokens, or the config's run), C = 6 N D. Where the run lies outside the fitted runs' N or D, or
differs from them in what sets the loss's units (vocabulary, sequence length, corpus), a note says so.
"""

from __future__ import annotations

from lmforge.model.accounting import count_params
from lmforge.spec.scaling_law import Fit


def predict_loss(fit_path: str, cfg, train_tokens: float) -> dict:
    """The prediction for `cfg` trained on `train_tokens` tokens: {"n_params", "tokens", "compute",
    "predicted", "law_interval", "run_interval", "level", "optimal": {...}, "notes": [...]}."""
    fit = Fit.load(fit_path)
    n = count_params(cfg.model)["non_embedding"]
    p = fit.predict(n, train_tokens)
    compute = 6.0 * n * train_tokens
    return {"fit": str(fit_path), "n_params": n, "tokens": train_tokens, "compute": compute, "predicted": p.loss,
            "law_interval": list(p.law_interval), "run_interval": list(p.run_interval), "level": p.level,
            "optimal": fit.optimal(compute), "notes": _notes(fit, cfg, n, train_tokens)}


def _notes(fit: Fit, cfg, n: float, d: float) -> list[str]:
    runs = fit.record.get("runs", [])
    notes = []
    for name, value, what in (("N", n, "n_params"), ("D", d, "tokens")):
        lo, hi = min(r[what] for r in runs), max(r[what] for r in runs)
        if not lo <= value <= hi:
            notes.append(f"{name} = {value:,.0f} lies outside the fitted runs' {lo:,.0f}-{hi:,.0f}: an extrapolation "
                         f"({value / (hi if value > hi else lo):.3g}x the {'largest' if value > hi else 'smallest'})")
    for key, mine in (("vocab_size", cfg.model.vocab_size), ("seq_len", cfg.data.seq_len),
                      ("corpus", str(cfg.data.corpus))):
        theirs = sorted({str(r[key]) for r in runs if key in r})
        if theirs and theirs != [str(mine)]:
            notes.append(f"the fit's runs have {key} {', '.join(theirs)}, this run {mine}: the loss is per token of "
                         f"another tokenisation or context, so the prediction does not apply as is")
    return notes


def loss_lines(pred: dict) -> list[str]:
    """The lines `lmforge plan` prints for a prediction."""
    level = f"{pred['level']:.0%}"
    (llo, lhi), (rlo, rhi) = pred["law_interval"], pred["run_interval"]
    opt = pred["optimal"]
    (nlo, nhi), (dlo, dhi) = opt["n_interval"], opt["d_interval"]
    lines = [f"Loss (scaling law {pred['fit']}):",
             f"  this run: N = {pred['n_params']:,} non-embedding parameters, D = {pred['tokens']:,.0f} tokens, "
             f"C = 6ND = {pred['compute']:.3g} FLOPs",
             f"  predicted final validation loss {pred['predicted']:.4f} ({level} interval {rlo:.4f}-{rhi:.4f} for one "
             f"run; of the law alone {llo:.4f}-{lhi:.4f})",
             f"  compute-optimal at {pred['compute']:.3g} FLOPs: N = {opt['n_opt']:,.0f} [{nlo:,.0f}, {nhi:,.0f}], "
             f"D = {opt['d_opt']:,.0f} [{dlo:,.0f}, {dhi:,.0f}] tokens, loss {opt['loss']:.4f}"]
    lines += [f"  note: {note}" for note in pred["notes"]]
    return lines

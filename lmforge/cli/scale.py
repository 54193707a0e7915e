"""`lmforge scale`: scaling laws from lmforge's own runs.

    lmforge scale sweep --config tiny --models 64x2,96x3,128x4 --budgets 1e12,3e12,1e13 [--parallel K]
                        [--out runs/scale-tiny] [--min-steps 20] [--dry-run] [--section.key value ...]
    lmforge scale fit RUNS... [--out FIT.json] [--bootstrap 200] [--level 0.95] [--budgets C1,C2]
                      [--holdout RUN ...] [--plot FILE.png]

`sweep` lays out an IsoFLOP grid (lmforge/scale/grid.py: each model DIMxLAYERS of the preset's family at
each budget C, trained for D = C / (6 N) tokens) as a `lmforge sweep` spec (OUT/isoflop.toml, listed
trials) and runs it with the sweep machinery: resumable, trials in parallel, ranked results in OUT.
`fit` reads finished runs (run folders, or sweep folders: their trials), fits L(N, D) = E + A / N^alpha +
B / D^beta (lmforge/scale/fit.py: Hoffmann et al.'s approach 3, bootstrap intervals) and writes FIT.json
with the compute-optimal N and D per budget; `lmforge plan --loss FIT.json` predicts a planned run's loss
from it. `--holdout RUN` leaves a run out of the fit and says whether its loss lands in the prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lmforge.config import ConfigError, parse_cli_overrides
from lmforge.cli.options import OptionParser, float_in, int_in, positive_int, seed

SPEC_FILE = "isoflop.toml"  # the sweep spec `lmforge scale sweep` writes into its sweep folder


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    s = sub.add_parser("sweep", help="run an IsoFLOP grid as a `lmforge sweep`")
    s.add_argument("--config", "--base", dest="config", default="tiny", help="preset or TOML file: the family")
    s.add_argument("--models", required=True, help="model shapes DIMxLAYERS, comma-separated, e.g. 64x2,96x3,128x4")
    s.add_argument("--budgets", required=True, help="compute budgets C = 6ND in FLOPs, e.g. 1e12,3e12,1e13")
    s.add_argument("--min-steps", type=positive_int, default=20, help="leave out a model/budget pair with fewer steps")
    s.add_argument("--out", type=Path, default=None, help="sweep folder (default runs/scale-<config>)")
    s.add_argument("--parallel", type=positive_int, default=1, help="trials at once (lmforge sweep --parallel)")
    s.add_argument("--dry-run", action="store_true", help="print the grid and write the spec; run nothing")
    f = sub.add_parser("fit", help="fit L(N, D) to finished runs; write FIT.json")
    f.add_argument("runs", nargs="+", help="run folders, or sweep folders (their trials)")
    f.add_argument("--out", type=Path, default=Path("FIT.json"), help="the fit's file (default FIT.json)")
    f.add_argument("--bootstrap", type=int_in(2, note="the intervals FIT.json and lmforge plan --loss report are "
                                                    "percentiles over the resamples"), default=200,
                   help="bootstrap resamples for the intervals (default 200; at least 2)")
    f.add_argument("--level", type=float_in(0, 1, lo_open=True, hi_open=True), default=0.95, help="interval level (default 0.95)")
    f.add_argument("--budgets", default=None,
                   help="budgets (FLOPs) for the compute-optimal table (default: the runs' 6ND, grouped)")
    f.add_argument("--holdout", action="append", default=[], metavar="RUN",
                   help="a run left out of the fit; its loss is compared with the prediction (repeatable)")
    f.add_argument("--plot", type=Path, default=None, help="write the IsoFLOP plot (PNG) here")
    f.add_argument("--seed", type=seed, default=0, help="seed of the bootstrap resampling")
    return p


def scale_main(argv: list[str]) -> int:
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.action == "sweep":
            return _sweep(args, rest)
        if rest:
            raise ConfigError(f"lmforge scale fit: unexpected arguments {rest}")
        return _fit(args)
    except ValueError as exc:  # ConfigError included
        print(f"lmforge scale: error: {exc}", file=sys.stderr)
        return 2


def _sweep(args: argparse.Namespace, rest: list[str]) -> int:
    from lmforge.folders import atomic_write
    from lmforge.scale.grid import grid_table, isoflop_grid, parse_budgets, parse_models
    from lmforge.cli.sweep import sweep_main

    base = parse_cli_overrides([a for a in rest if a != "--"])
    points, notes = isoflop_grid(args.config, base, parse_models(args.models), parse_budgets(args.budgets),
                                 args.min_steps)
    out = args.out or Path(f"runs/scale-{Path(args.config).stem}")
    print(f"IsoFLOP grid of {args.config!r}: {len(points)} runs")
    print(grid_table(points))
    for note in notes:
        print(f"  note: {note}")
    spec = out / SPEC_FILE
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(spec, spec_toml(args.config, base, [p.overrides for p in points], out, args.parallel))
    print(f"sweep spec: {spec} (`lmforge sweep --spec {spec}` runs or resumes it)")
    if args.dry_run:
        return 0
    return sweep_main(["--spec", str(spec)])


def spec_toml(config: str, base: dict, trials: list[dict], out: Path, parallel: int) -> str:
    """A `lmforge sweep --spec` file: the base overrides and one [[trial]] per grid point."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return _toml_string(v)
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{_toml_string(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise ConfigError(f"cannot write {v!r} into a sweep spec")

    lines = ["# An IsoFLOP grid written by `lmforge scale sweep`; `lmforge sweep --spec THIS_FILE` runs it.",
             f"config = {_toml_string(config)}", f"out = {_toml_string(str(out))}", f"parallel = {parallel}", "",
             "[base]"]
    lines += [f"{_toml_string(k)} = {value(v)}" for k, v in base.items()]
    for trial in trials:
        lines += ["", "[[trial]]"] + [f"{_toml_string(k)} = {value(v)}" for k, v in trial.items()]
    return "\n".join(lines) + "\n"


def _toml_string(s: str) -> str:
    return json.dumps(s)  # a JSON string of printable text is a TOML basic string


def default_budgets(flops: list[float]) -> list[float]:
    """Budgets from the runs' 6ND: runs within 25% of each other are one budget (the median, 2
    significant digits), as the steps of an IsoFLOP grid's runs round their 6ND apart."""
    groups: list[list[float]] = []
    for c in sorted(flops):
        if groups and c / groups[-1][0] < 1.25:
            groups[-1].append(c)
        else:
            groups.append([c])
    return sorted({float(f"{g[len(g) // 2]:.2g}") for g in groups})


def _fit(args: argparse.Namespace) -> int:
    from lmforge.folders import atomic_write_json
    from lmforge.scale.fit import fit_law, fit_record
    from lmforge.scale.grid import parse_budgets
    from lmforge.spec.scaling_law import Fit
    from lmforge.scale.runs import collect

    held = collect(args.holdout) if args.holdout else []
    held_runs = {h["run"] for h in held}
    points = [p for p in collect(args.runs) if p["run"] not in held_runs]
    budgets = parse_budgets(args.budgets) if args.budgets else default_budgets([p["flops"] for p in points])
    result = fit_law([p["n_params"] for p in points], [p["tokens"] for p in points], [p["loss"] for p in points],
                     n_boot=args.bootstrap, level=args.level, seed=args.seed)
    what = {"n_params": "non-embedding parameters (lmforge.model.accounting.count_params)",
            "tokens": "training tokens (summary.json)", "loss": "final validation loss, nats/token (summary.json)",
            "compute": "C = 6 N D"}
    record = fit_record(result, points, budgets, what)
    fit = Fit(result.law, result.bootstrap, result.residuals, result.level, record)
    if held:
        record["held_out"] = [_held_out(fit, h) for h in held]
    atomic_write_json(args.out, record, indent=1)
    print(fit_summary(fit, len(points)))
    for h in record.get("held_out", []):
        lo, hi = h["run_interval"]
        print(f"held out {h['run']}: N {h['n_params']:,}, D {h['tokens']:,}: measured {h['loss']:.4f}, predicted "
              f"{h['predicted']:.4f} ({fit.level:.0%} interval {lo:.4f}-{hi:.4f}): "
              f"{'inside' if h['inside'] else 'OUTSIDE'}")
    if args.plot is not None:
        from lmforge.scale.plot import plot_fit

        plot_fit(fit, budgets, args.plot, held)
        print(f"plot: {args.plot}")
    print(f"fit: {args.out}")
    return 0


def _held_out(fit, h: dict) -> dict:
    p = fit.predict(h["n_params"], h["tokens"])
    return {**h, "predicted": p.loss, "law_interval": list(p.law_interval), "run_interval": list(p.run_interval),
            "inside": p.run_interval[0] <= h["loss"] <= p.run_interval[1]}


def fit_summary(fit, n_runs: int) -> str:
    """The law with its intervals and the compute-optimal table, as printed by `lmforge scale fit`."""
    law, rec = fit.law, fit.record
    rms = math.sqrt(sum(r * r for r in fit.residuals) / len(fit.residuals))
    lines = [f"L(N, D) = E + A / N^alpha + B / D^beta, fitted to {n_runs} runs (rms log residual {rms:.4f}; "
             f"{len(fit.bootstrap)} bootstrap fits, {fit.level:.0%} intervals):"]
    for name in ("E", "A", "B", "alpha", "beta"):
        lo, hi = rec["intervals"][name]
        lines.append(f"  {name:5s} = {getattr(law, name):10.4g}   [{lo:.4g}, {hi:.4g}]")
    lines.append("compute-optimal (C = 6ND):")
    for row in rec["compute_optimal"]:
        (nlo, nhi), (dlo, dhi) = row["n_interval"], row["d_interval"]
        lines.append(f"  C {row['compute']:9.3g}: N_opt {row['n_opt']:11,.0f} [{nlo:,.0f}, {nhi:,.0f}]   "
                     f"D_opt {row['d_opt']:13,.0f} [{dlo:,.0f}, {dhi:,.0f}]   loss {row['loss']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(scale_main(sys.argv[1:]))

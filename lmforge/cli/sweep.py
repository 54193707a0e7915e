"""`lmforge sweep`: grid or random search over config keys, resumable, ranked by validation loss.

    lmforge sweep --grid optim.lr=1e-3,3e-4 --grid schedule.warmup_steps=10,20        # 2x2 grid
    lmforge sweep --random 8 --seed 0 --range optim.lr=1e-4:1e-2:log --grid train.global_batch_size=16,32
    lmforge sweep --spec sweep.toml --parallel 2 --out runs/sweep-lr -- --train.steps 100
    lmforge sweep --base gpt2-124m --grid optim.lr=6e-4,3e-4 --train.steps 2000      # base config + overrides

Any `--section.key value` that is not a sweep option is a base override applied to every trial.
`--range KEY=LOW:HIGH[:log|:int]` draws from a continuous range (random search only). A spec file
(TOML) holds the same things:

    config = "tiny"
    random = 8          # omit for a full grid
    seed = 0
    parallel = 2
    [base]
    "train.steps" = 100
    [grid]
    "optim.lr" = [1e-3, 3e-4]
    [range]
    "schedule.warmup_steps" = [5, 50, "int"]

Trials whose keys vary together are listed one by one (each crossed with the grid, if any), e.g.
an IsoFLOP grid (`lmforge scale sweep` writes one):

    [[trial]]
    "model.dim" = 64
    "train.steps" = 400
    [[trial]]
    "model.dim" = 128
    "train.steps" = 100

Re-running the same command resumes: finished trials (with summary.json) are skipped. A folder
holds one sweep: a different sweep (other keys, values, trial count, seed, config or base) never
overwrites it. With --out (or `out` in the spec) that is an error; the default folder
runs/sweep-<config> passes the new sweep on to one named after it, e.g. runs/sweep-tiny-random8-lr.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from lmforge.config import ConfigError, parse_cli_overrides, parse_override_value
from lmforge.cli.options import OptionParser, positive_int, seed


def flatten_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim.lr": 1e-3, ...} of nested tables {"optim": {"lr": 1e-3}} (lists stay whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_grid(text: str):
    from lmforge.sweep.core import Dimension

    if "=" not in text:
        raise ConfigError(f"--grid {text!r}: use KEY=V1,V2,... e.g. --grid optim.lr=1e-3,3e-4")
    key, values = text.split("=", 1)
    vals = [parse_override_value(v.strip()) for v in values.split(",") if v.strip()]
    if not vals:
        raise ConfigError(f"--grid {text!r}: no values")
    return Dimension(key.strip().lstrip("-").replace("-", "_"), values=vals)


def parse_range(text: str):
    from lmforge.sweep.core import Dimension

    try:
        key, rest = text.split("=", 1)
        parts = rest.split(":")
        low, high = float(parts[0]), float(parts[1])
        scale = parts[2] if len(parts) > 2 else "linear"
    except (ValueError, IndexError):
        raise ConfigError(f"--range {text!r}: use KEY=LOW:HIGH[:log|:int], e.g. optim.lr=1e-4:1e-2:log") from None
    if scale not in ("linear", "log", "int") or not low < high or (scale == "log" and low <= 0):
        raise ConfigError(f"--range {text!r}: need LOW < HIGH (both > 0 for log) and scale linear, log or int")
    return Dimension(key.strip().replace("-", "_"), low=low, high=high, scale=scale)


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", "--base", dest="config", default=None,
                   help="preset name or TOML file of the base config (default: tiny)")
    p.add_argument("--spec", type=Path, default=None, help="sweep spec TOML (see `lmforge sweep --help`)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="discrete values of a key")
    p.add_argument("--range", action="append", default=[], metavar="KEY=LO:HI[:log|:int]",
                   help="continuous range of a key (with --random)")
    p.add_argument("--random", type=positive_int, default=None, metavar="N", help="random search: N trials (default: grid)")
    p.add_argument("--seed", type=seed, default=None, help="seed of the random search (default 0)")
    p.add_argument("--parallel", type=positive_int, default=None, metavar="K", help="trials run at once (default 1)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per trial (default: cores / parallel when parallel > 1)")
    p.add_argument("--metric", default=None, help="summary.json key to rank by, lower is better (default val_loss)")
    p.add_argument("--out", type=Path, default=None, help="sweep folder (default runs/sweep-<config>, or "
                   "runs/sweep-<config>-<search> when that holds another sweep)")
    p.add_argument("--no-report", action="store_true", help="skip the HTML report of overlaid curves")
    return p


class SweepArgs(NamedTuple):
    spec: Any  # SweepSpec
    parallel: int
    out: Path  # --out, `out` of the spec file, or the default runs/sweep-<config>
    threads: int | None
    report: bool
    out_given: bool  # --out or the spec file's `out`: never replaced by another folder


def parse_sweep_args(argv: list[str] | None) -> SweepArgs:
    """The sweep's settings from the command line (+ spec file)."""
    from lmforge.sweep.core import Dimension, SweepSpec

    args, rest = build_parser().parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    file: dict[str, Any] = {}
    if args.spec is not None:
        try:
            file = tomllib.loads(args.spec.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"--spec {args.spec}: {exc}") from exc
    space: dict[str, Dimension] = {}
    for key, values in flatten_keys(file.get("grid", {})).items():
        space[key] = Dimension(key, values=list(values) if isinstance(values, list) else [values])
    for key, r in flatten_keys(file.get("range", {})).items():
        if not isinstance(r, list) or len(r) not in (2, 3) or (len(r) == 3 and r[2] not in ("linear", "log", "int")):
            raise ConfigError(f"spec [range] {key} = {r!r}: use [low, high] or [low, high, \"log\"|\"int\"]")
        space[key] = Dimension(key, low=float(r[0]), high=float(r[1]), scale=r[2] if len(r) == 3 else "linear")
    for text in args.grid:
        d = parse_grid(text)
        space[d.key] = d
    for text in args.range:
        d = parse_range(text)
        space[d.key] = d
    listed = file.get("trial", [])
    if not isinstance(listed, list) or not all(isinstance(t, dict) and t for t in listed):
        raise ConfigError(f"--spec {args.spec}: `trial` must be [[trial]] tables of dotted keys, e.g. "
                          f"[[trial]] \"model.dim\" = 64 \"train.steps\" = 100")
    base = {**flatten_keys(file.get("base", {})), **parse_cli_overrides(rest)}
    spec = SweepSpec(
        config=args.config or file.get("config", "tiny"), base=base, space=list(space.values()),
        random_trials=args.random if args.random is not None else int(file.get("random", 0)),
        seed=args.seed if args.seed is not None else int(file.get("seed", 0)),
        metric=args.metric or file.get("metric", "val_loss"), listed=[flatten_keys(t) for t in listed])
    parallel = args.parallel or int(file.get("parallel", 1))
    if parallel < 1:
        raise ConfigError(f"--parallel {parallel} must be >= 1")
    explicit = args.out is not None or "out" in file
    out = args.out or Path(file.get("out", f"runs/sweep-{Path(spec.config).stem}"))
    return SweepArgs(spec, parallel, out, args.threads, not args.no_report, explicit)


def sweep_main(argv: list[str] | None = None) -> int:
    from lmforge.sweep.core import RESULTS_CSV, RESULTS_JSON, SWEEP_PLOT, format_table, resolve_sweep_dir, run_sweep

    try:
        spec, parallel, out, threads, report, out_given = parse_sweep_args(argv)
        spec.trials()  # a spec without a search space says so before any folder is looked at
        out = resolve_sweep_dir(spec, out, explicit=out_given)
        trials = run_sweep(spec, out, parallel=parallel, threads_per_trial=threads, report=report)
    except ValueError as exc:  # ConfigError, or a --out that is another kind of folder
        print(f"{'config error' if isinstance(exc, ConfigError) else 'error'}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # (SIGINT, or SIGTERM: sweep.core.SweepInterrupted) the trials are stopped
        return 128 + int(getattr(exc, "signum", 2))
    import json

    rows = json.loads((out / RESULTS_JSON).read_text())
    print(f"\nresults ranked by {spec.metric} ({out / RESULTS_CSV}, plot {out / SWEEP_PLOT}):")
    print(format_table(rows, spec.keys()))
    failed = [t for t in trials if t.status == "failed"]
    if failed:
        print(f"\n{len(failed)} trial(s) failed; their train.log says why. Re-run to retry them.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(sweep_main())

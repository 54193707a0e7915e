"""`lmforge compare RUN_A RUN_B`: is a run (say, on GPUs under a new layout) the same training as a
reference run? Their loss and gradient norm, step by step, within a band (lmforge.verify.band).

    lmforge compare runs/tp8 runs/one-gpu --band loss=2e-3,grad_norm=2e-2     # a band given
    lmforge compare runs/tp8 runs/one-gpu --reference runs/one-gpu-seed2 runs/one-gpu-seed3   # a band measured

RUN_B is the reference; the band is given (`--band`: absolute loss, relative grad norm, every step) or
measured from other runs of RUN_B's config passed as `--reference` (reruns, seeds: their largest distance
from RUN_B per step, times --factor; lmforge/verify/band.py states the statistic). Exit status 0 when every
step of RUN_B is within the band in RUN_A, 1 otherwise (one line per step outside), 2 on bad input.
"""

from __future__ import annotations

import sys

from lmforge.cli.options import OptionParser, float_in
from lmforge.verify.band import BAND_FACTOR, compare_runs, measure_band, parse_band, read_metrics


def build_parser() -> OptionParser:
    p = OptionParser(prog="lmforge compare", description="Compare two runs' loss and gradient norm per "
                                "step within a band; exit 0 within, 1 outside.")
    p.add_argument("run_a", metavar="RUN_A", help="the run checked (a run folder with metrics.jsonl)")
    p.add_argument("run_b", metavar="RUN_B", help="the reference run")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--band", help="loss=ABS,grad_norm=REL: the largest absolute loss difference and relative "
                     "grad-norm difference a step may show")
    how.add_argument("--reference", nargs="+", metavar="RUN", help="other runs of RUN_B's config (reruns or seeds): "
                     "the band is measured from their distance to RUN_B")
    p.add_argument("--factor", type=float_in(0, lo_open=True), default=BAND_FACTOR, help="times the measured spread (with --reference; "
                   f"default {BAND_FACTOR:g})")
    return p


def compare_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.band:
            band = parse_band(args.band)
        else:
            want = read_metrics(args.run_b)
            band = measure_band(want, [read_metrics(r) for r in args.reference], args.factor,
                                how=f"band measured from {len(args.reference)} reference run(s) x {args.factor:g}")
        parity = compare_runs(args.run_a, args.run_b, band)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"compare {args.run_a} against {args.run_b}, steps {parity.steps[0]}-{parity.steps[-1]}")
    print(f"  {band.describe(parity.steps)}")
    lines = parity.step_lines()
    for line in lines:
        print(f"  {line}")
    print(f"{'PASS' if parity.ok else 'FAIL'}: {parity.summary()}"
          + (f"; {len(lines)} step(s) outside the band" if lines else ""))
    return 0 if parity.ok else 1

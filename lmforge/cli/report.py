"""`lmforge report --run RUN_DIR [--run RUN_DIR ...] [--out DIR] [--embed]` (or RUN_DIR positional)

Plots (loss train/val, LR, grad norm, throughput; several runs overlaid) as PNG and one HTML page
summarising config, hardware, final metrics, health events and samples. A folder that is not a
run (no metrics.jsonl), e.g. a sweep folder, stands for the runs inside it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.cli.options import OptionParser
from lmforge.folders import REPORT


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge report", description=__doc__.split("\n\n")[1])
    p.add_argument("--run", dest="run", action="append", type=Path, default=[], metavar="RUN_DIR",
                   help="a run folder written by `lmforge train`, or a sweep folder (repeatable)")
    p.add_argument("runs", nargs="*", type=Path, metavar="RUN_DIR", help="the same, positional (the old form)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: RUN_DIR/report for one run, ./lmforge-report for several)")
    p.add_argument("--embed", action="store_true", help="embed the PNGs in the HTML (one self-contained file)")
    p.add_argument("--title", default=None)
    return p


def report_main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.runs = args.run + args.runs
    if not args.runs:
        parser.error("give a run folder: --run RUN_DIR (repeatable)")
    from lmforge.report.html import build_report, find_runs

    try:
        runs = find_runs(args.runs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or (runs[0] / REPORT if len(runs) == 1 else Path("lmforge-report"))
    try:
        page = build_report(runs, out, embed=args.embed, title=args.title)
    except ImportError as exc:
        print(f"error: lmforge report needs matplotlib ({exc}); `pip install matplotlib`", file=sys.stderr)
        return 2
    print(f"report: {page} ({len(runs)} run{'s' if len(runs) > 1 else ''}; plots in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(report_main())

"""μP's coordinate check (issue 48 item 1; lmforge.train.coord_check): how far each layer's activations
move over the first AdamW steps, against width, under SP and under μP.

    python benchmarks/mup_coord_check.py --plot benchmarks/mup_coord_check.png

Prints per layer the exponent of the growth with width (slope of log mean|x_t - x_0| against
log width; 0 = flat) and the changes themselves, and draws them (--plot). The defaults are those of
tests/test_mup.py's check: a 2-layer model (4 heads, GQA with 2 kv heads, SwiGLU, fused q/k/v, tied
embeddings, vocab 256) at widths 64-512, base width 64, 6 AdamW steps at lr 1e-2 on one batch of
8 x 32 random tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmforge.train.coord_check import compare, parser, report


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    ap.add_argument("--plot", type=Path, default=None, help="PNG: change against width per layer, SP and μP")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = compare(args.widths, args.lr, args.steps, args.seed)
    rc = report(results)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        layers = list(results["sp"][args.widths[0]])
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, (p, r) in zip(axes, results.items()):
            for name in layers:
                ax.plot(args.widths, [sum(r[w][name]) / args.steps for w in args.widths], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("width (model.dim)")
            ax.set_title(f"{'SP' if p == 'sp' else 'μP'}: mean |x_t - x_0|, {args.steps} AdamW steps at lr {args.lr:g}")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("activation change per coordinate")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

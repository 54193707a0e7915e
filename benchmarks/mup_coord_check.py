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

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.train.coord_check import coordinate_check, growth_exponents


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512])
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="PNG: change against width per layer, SP and μP")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = ModelConfig(vocab_size=256, dim=args.widths[0], n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                       mup_base_width=args.widths[0])
    optim = OptimConfig(name="adamw", lr=args.lr, weight_decay=0.0)
    results = {p: coordinate_check(dataclasses.replace(base, parametrization=p), args.widths, optim, args.steps,
                                   seed=args.seed) for p in ("sp", "mup")}
    layers = list(results["sp"][args.widths[0]])
    print("| layer | " + " | ".join(f"{p} {w}" for p in results for w in args.widths) + " | SP exponent | μP exponent |")
    print("|---|" + "---|" * (2 * len(args.widths) + 2))
    exps = {p: growth_exponents(r) for p, r in results.items()}
    for name in layers:
        cells = [f"{sum(results[p][w][name]) / args.steps:.3g}" for p in results for w in args.widths]
        print(f"| {name} | " + " | ".join(cells) + f" | {exps['sp'][name]:.2f} | {exps['mup'][name]:.2f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
